"""How a task reads the answer out of a completion: one rule per task config (``answer = ...``).

- ``"exact"``: the whole completion, whitespace aside, is the answer (a model trained to answer bare: " 46");
- ``"last_number"``: the last number in the completion ("17 + 25 = 42." reads 42; "1,234" reads 1234);
- ``"answer_line"``: the last line that starts with ``Answer:`` (any case), the rest of that line
  ("...so we carry the one.\\nAnswer: 42" reads "42"), a trailing full stop dropped.

A rule that finds nothing reads None, which every verifier judges wrong.

A task's worked solution (the warm start's target, ``sgt_ref``'s reference) is its ``solution`` template with
the answer in it: ``"{answer}"`` (bare) by default, ``"The answer is {answer}."`` for a model that answers in
words; the template must read back as the answer under the task's rule (``check_solution``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

AnswerRule = Literal["exact", "last_number", "answer_line"]
ANSWER_RULES: tuple[str, ...] = ("exact", "last_number", "answer_line")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_ANSWER_LINE = re.compile(r"^\s*answer\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)


def read_answer(rule: AnswerRule, completion: str) -> str | None:
    """The answer ``completion`` gives under ``rule``, or None when it gives none."""
    if rule == "exact":
        return completion.strip() or None
    if rule == "last_number":
        numbers = _NUMBER.findall(_THOUSANDS.sub("", completion))
        return numbers[-1] if numbers else None
    if rule == "answer_line":
        lines = _ANSWER_LINE.findall(completion)
        return lines[-1].removesuffix(".").strip() or None if lines else None
    raise ValueError(f"unknown answer rule {rule!r}; expected one of {', '.join(ANSWER_RULES)}")


def check_solution(template: str, rule: AnswerRule) -> None:
    """Raise ValueError unless ``template`` holds ``{answer}`` once and reads back as the answer under ``rule``."""
    if template.count("{answer}") != 1 or template.count("{") != 1:
        raise ValueError(f"solution {template!r} must hold {{answer}} once and no other braces")
    for answer in ("-12", "7"):
        if read_answer(rule, template.format(answer=answer)) != answer:
            raise ValueError(f"solution {template!r} does not read back as its answer under answer = {rule!r}")


# --- the strict check of a free-form answer (tasks.jsonl's default): where the answer may stand ---

_BOXED = re.compile(r"\\boxed\s*\{")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
# a whole number (thousands commas allowed), a decimal, a fraction, or a LaTeX command with its {arguments}
_END_EXPRESSION = re.compile(r"(?:^|(?<=[\s=:$(]))([-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?"
                             r"|[-+]?\\[A-Za-z]+(?:\{[^{}]*\})*)$")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
_TRAILING = ".!*$ \t\r\n"


def strict_answer(completion: str) -> str | None:
    """The one answer a completion gives, read strictly, or None: the content of its ``\\boxed{}`` (every box
    the same), else of its ``Answer:`` lines (every one the same), else the whole completion when it is one
    ASCII expression and no words, else a number or LaTeX expression standing at its very end (after a space,
    "=", ":", "$" or "(", before nothing but ".", "!", "*" or "$"). Trailing junk, digits glued to letters,
    several different answers and non-ASCII digits read None."""
    for found in (_boxed(completion), [a.removesuffix(".").strip() for a in _ANSWER_LINE.findall(completion)]):
        if found:
            return found[0] if len(set(found)) == 1 and found[0] and found[0].isascii() else None
    text = completion.strip().rstrip(_TRAILING).lstrip("$* ")
    if text and text.isascii() and not re.search(r"[A-Za-z]{2}", _LATEX_COMMAND.sub("", text)):
        return text.rpartition("=")[2].strip() or None  # "1 + 1 = 2" answers 2
    end = _END_EXPRESSION.search(text)
    return end.group(1) if end else None


def _boxed(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` (nested braces balanced); an unclosed one reads as nothing."""
    out = []
    for start in _BOXED.finditer(text):
        depth, i = 1, start.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[start.end():i - 1].strip())
    return out


def plain_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is a plain one ("1,234", "-0.5", "3/4"), else None."""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
