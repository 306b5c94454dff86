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

import math
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


# --- the number a completion states as its answer (the strict check when the reference is a plain number) ---

# a whole number (thousands commas allowed), a decimal or a fraction, never the tail of a longer number
_NUM = r"(?<![0-9.,/])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?(?![0-9])"
# what may follow it: emphasis or math delimiters, "%", a unit word (+ "in total" and the like), a full stop
_TAIL = (r"[*_`$]*(?:%|\s+[*_]*(?P<unit>[A-Za-z]+)(?:\s+(?:in total|in all|altogether|total|left|each|remaining))?)?"
         r"[*_`$.\s]*")
_LAST_NUMBER = re.compile(rf"(?P<num>{_NUM})(?:{_TAIL})$")
_ONE_NUMBER = re.compile(rf"[*_`$\s]*(?:[A-Za-z]\s*=\s*[*_`$]*)?(?P<num>{_NUM})(?:{_TAIL})")
_ANY_NUMBER = re.compile(_NUM)
_STATEMENT = re.compile(r"\banswer\b[*_\s]*(?:is\b|:|=)[*_:\s]*(?P<rest>[^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.?](?=\s|$)")  # not "!": right after a number it is a factorial
_CLAUSE_BREAK = re.compile(r"[=\n;]|[.?!:,](?=\s)")
# words that make the number after them one of several candidates, a bound or part of an expression
_BEFORE_NOT = frozenset("or nor and either maybe perhaps possibly plus minus times over by than not least most "
                        "between from vs versus except".split())
# words that change the number before them ("5 thousand", "5 squared", "5 or more") or go on past it ("5 is")
_AFTER_NOT = frozenset("or nor and plus minus times over divided squared cubed factorial hundred thousand million "
                       "billion trillion dozen more less fewer is are was were not".split())
# LaTeX an answer is written in, as plain text: \\frac{3}{4} as 3/4, \\text{ apples} as a word, \\(..\\) as $
_LATEX = [(re.compile(r"\\[dt]?frac\{(-?[0-9]+)\}\{([0-9]+)\}"), r"\1/\2"),
          (re.compile(r"\\[dt]?frac([0-9])([0-9])"), r"\1/\2"),
          (re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}"), r" \1"),
          (re.compile(r"\\[()\[\]]"), "$"), (re.compile(r"\\([%$])"), r"\1"), (re.compile(r"\\[,!;]"), ""),
          (re.compile("\u2212"), "-")]  # the Unicode minus sign


def stated_number(completion: str) -> Fraction | None:
    """The one number ``completion`` states as its answer, or None. Its answers are its ``\\boxed{}`` contents
    (each one number) and its answer statements ("Answer: 5", "the answer is 5", to the sentence's end); with
    none, the number ending it. Emphasis, ``$``, a unit word and a full stop may surround the number. None: no
    answer, answers that differ, an expression ("2 + 3", "5!", "10/2"; a fraction must be in lowest terms), a
    number after "or"/"and"/"maybe"... or beside another number in its clause ("6 or 5", "either 4 or 5"),
    digits glued to letters, non-ASCII digits."""
    boxes, text = _unbox(completion)
    answers = [_one_number(box) for box in boxes]
    answers += [_final_number(_SENTENCE_END.split(m["rest"])[0]) for m in _STATEMENT.finditer(_latex_plain(text))]
    if not answers:
        return _final_number(_latex_plain(text))
    return answers[0] if None not in answers and len(set(answers)) == 1 else None


def _one_number(text: str) -> Fraction | None:
    """``text`` when it is one number and nothing else but emphasis, a unit and a full stop ("**5** apples.")."""
    found = _ONE_NUMBER.fullmatch(_latex_plain(text))
    return _value(found["num"]) if found and (found["unit"] or "").lower() not in _AFTER_NOT else None


def _final_number(text: str) -> Fraction | None:
    """The number ending ``text``, when it stands alone: after a word, "=", ":", "#" or a sentence, not after an
    operator, a hedge (``_BEFORE_NOT``) or another number in its clause."""
    found = _LAST_NUMBER.search(text.strip())
    if not found or (found["unit"] or "").lower() in _AFTER_NOT:
        return None
    lead = text.strip()[:found.start()]
    if lead and not (lead[-1].isspace() or lead[-1] in "*_`$=:#"):
        return None  # glued to what comes before: "abc2", "(5", "~5", "-(-5"
    before = lead.rstrip("*_`$, \t\r\n")
    if before and before[-1].isalpha():
        if re.search(r"[^\W\d_]+$", before).group().lower() in _BEFORE_NOT:  # any script's letters: "é 5" too
            return None
    elif before and before[-1] not in "=:#.?!":
        return None  # after an operator or another number: "2 + 3", "4, 5", "4\n5"
    value = _value(found["num"])
    clause = _CLAUSE_BREAK.split(lead)[-1]  # the other numbers in it are other candidates ("not 4 but 5")
    return value if all(_value(n) == value for n in _ANY_NUMBER.findall(clause)) else None


def _value(token: str) -> Fraction | None:
    """A number token's value; a fraction only in lowest terms ("3/4", not "10/2" or "6/8", which are sums to do)."""
    top, _, bottom = token.replace(",", "").partition("/")
    if len(top) + len(bottom) > 400:
        return None  # no answer is this long, and int() refuses over 4,300 digits
    if not bottom:
        return Fraction(top)
    p, q = int(top), int(bottom)
    return Fraction(p, q) if q > 1 and math.gcd(p, q) == 1 else None


def _latex_plain(text: str) -> str:
    """``text`` with the LaTeX of ``_LATEX`` made plain."""
    for pattern, plain in _LATEX:
        text = pattern.sub(plain, text)
    return text


def _unbox(text: str) -> tuple[list[str], str]:
    """The contents of every ``\\boxed{...}``, and ``text`` with each box replaced by its contents."""
    contents, parts, end = [], [], 0
    for start in _BOXED.finditer(text):
        if start.start() < end:
            continue  # a box inside a box is part of the outer one
        depth, i = 1, start.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            break  # unclosed: it and what follows stay as they are
        contents.append(text[start.end():i - 1].strip())
        parts += [text[end:start.start()], contents[-1]]
        end = i
    return contents, "".join(parts) + text[end:]


def plain_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is a plain one ("1,234", "-0.5", "3/4"), else None."""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
