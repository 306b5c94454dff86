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
