"""The strict answer check, row by row: what a completion is paid for, and why (issue 58, item 3).

Each row runs through the real ``AnswerJudge`` as ``kind = "jsonl"`` and ``kind = "dataset"`` tasks use it
(``answer_check = "strict"``, the default). A reference that is a plain number is paid only for the one number
the completion states as its answer; other references go to math-verify, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.answers import plain_number
from tasks.jsonl import AnswerJudge
from tasks.rewards import exact_answer

# (gold, completion, paid, why)
TABLE: list[tuple[str, str, bool, str]] = [
    # --- the answer 5: ordinary ways to state it ---
    ("5", "5", True, "a bare number"),
    ("5", " 5\n", True, "whitespace around it"),
    ("5", "5.", True, "a full stop after it"),
    ("5", "The answer is **5**.", True, "bold emphasis in an answer statement"),
    ("5", "*5*", True, "italic emphasis"),
    ("5", "`5`", True, "code emphasis"),
    ("5", "$5$", True, "LaTeX math delimiters"),
    ("5", "5 apples", True, "a unit word after it"),
    ("5", "Tom eats 3 and has 2 + 3 = 5 apples left.", True, "an equation ending in the number, then a unit"),
    ("5", "\\boxed{5}", True, "a box"),
    ("5", "So the total is $\\boxed{5}$.", True, "a box inside math, in a sentence"),
    ("5", "**Answer:** 5", True, "an Answer: line with bold markup"),
    ("5", "The final answer is:\n\n5", True, "an answer statement whose number is on the next line"),
    ("5", "The answer is 5, because 2 + 3 = 5.", True, "the statement's number and the equation's agree"),
    ("5", "2 + 3 = 5", True, "an equation: the number after the last '=' is stated"),
    ("5", "5.0", True, "the same value written as a decimal"),
    ("5", "\\boxed{5 \\text{ apples}}", True, "a LaTeX unit inside the box"),
    ("5", "Reasoning first.\n#### 5", True, "GSM8K's '#### answer' line"),
    # --- the answer 5: adversarial ---
    ("5", "2 + 3", False, "the question echoed back: an expression, not a stated number"),
    ("5", "What is 2 + 3?", False, "the question echoed back: it ends in a question"),
    ("5", "5!", False, "'!' right after a number is a factorial (120)"),
    ("5", "The answer is 5!", False, "a factorial inside an answer statement"),
    ("5", "10/2", False, "a fraction not in lowest terms is a division to do"),
    ("5", "\\boxed{2+3}", False, "a box holding an expression"),
    ("5", "6 or 5", False, "two candidates, the right one last"),
    ("5", "5 or 6", False, "two candidates, the right one first"),
    ("5", "either 4 or 5", False, "two candidates after 'either'"),
    ("5", "The answer is 6 or 5.", False, "two candidates inside an answer statement"),
    ("5", "4, or maybe 5", False, "a hedge word before the number"),
    ("5", "not 4 but 5", False, "another number in the same clause"),
    ("5", "4\n5", False, "two bare numbers"),
    ("5", "\\boxed{5} or \\boxed{6}", False, "two boxes that differ"),
    ("5", "Answer: 5\nAnswer: 6", False, "two answer lines that differ"),
    ("5", "The answer is 5.\n\\boxed{6}", False, "a statement and a box that differ"),
    ("5", "15", False, "the number inside a longer number"),
    ("5", "5.5", False, "the number as the start of a decimal"),
    ("5", "5abc", False, "digits glued to letters"),
    ("5", "abc5", False, "letters glued to digits"),
    ("5", "5 squared", False, "a word after it that makes an expression (25)"),
    ("5", "5 thousand", False, "a scale word after it (5000)"),
    ("5", "at least 5", False, "a bound, not an answer"),
    ("5", "\uff15", False, "a full-width digit: non-ASCII digits are refused"),
    ("5", "5 is", False, "trailing words that are not a unit"),
    ("5", "voilà 5", True, "a word ending in a non-ASCII letter before it (once an AttributeError that stopped runs)"),
    ("5", "", False, "nothing"),
    # --- negative answers ---
    ("-5", "-5", True, "a negative number"),
    ("-5", "x = -5", True, "a negative number after '='"),
    ("-5", "The temperature is \u22125 degrees.", True, "the Unicode minus sign and a unit"),
    ("-5", "5", False, "the sign dropped"),
    ("-5", "3 - 8", False, "a subtraction that evaluates to it"),
    ("-5", "--5", False, "a double sign is an expression"),
    # --- multi-digit answers ---
    ("1234", "It is 1,234.", True, "thousands separators"),
    ("1234", "1234 dollars", True, "a unit after a long number"),
    ("1,234", "\\boxed{1234}", True, "a reference with separators matches one without"),
    ("1234", "11234", False, "the answer inside a longer number"),
    ("1234", "1,2345", False, "a malformed separator is two numbers"),
    ("72", "Natalia sold 48 + 24 = 72 clips altogether.", True, "an ordinary worked answer with 'altogether'"),
    # --- decimals and fractions ---
    ("2.5", "2.5", True, "a decimal"),
    ("2.5", "The answer is 2.50.", True, "a trailing zero and a full stop"),
    ("2.5", "5/2", True, "the same value as a fraction in lowest terms"),
    ("2.5", "10/4", False, "a fraction not in lowest terms"),
    ("3/4", "\\frac{3}{4}", True, "a LaTeX fraction in lowest terms"),
    ("3/4", "0.75", True, "the same value as a decimal"),
    ("3/4", "6/8", False, "a fraction to reduce"),
    # --- references that are not plain numbers: math-verify on the one answer, as before ---
    ("\\frac{1}{2}", "0.5", True, "math-verify: equal value"),
    ("\\frac{1}{2}", "2abc99", False, "math-verify is only shown the answer the strict reading finds: none here"),
    ("x^2+1", "\\boxed{1 + x^2}", True, "math-verify: an equivalent expression"),
    ("x^2+1", "x^2+2", False, "math-verify: a different expression"),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}} or \\boxed{2}", False, "two boxes that differ"),
    ("Paris", "\\boxed{Paris}", True, "a word answer in a box"),
]


@pytest.fixture(scope="module")
def judge() -> Iterator[AnswerJudge]:
    judge = AnswerJudge("strict", 5.0, "test")
    yield judge
    judge._verifier.close()


@pytest.mark.parametrize(("gold", "completion", "paid", "why"), TABLE,
                         ids=[f"{i:02d}-{why}" for i, (_, _, _, why) in enumerate(TABLE)])
def test_the_strict_check_pays_only_a_stated_answer(judge: AnswerJudge, gold: str, completion: str, paid: bool,
                                                    why: str) -> None:
    verdict = judge(gold, completion)
    assert (verdict.verified, verdict.reward) == (paid, float(paid)), f"{gold!r} vs {completion!r}: {why}"


def test_a_numeric_reference_never_reaches_math_verify() -> None:
    """math-verify pays "2 + 3" for 5 through its expression parser; the numeric check must not ask it."""
    judge = AnswerJudge("strict", 5.0, "test")
    for completion in ("2 + 3", "5", "6 or 5", "\\boxed{10/2}"):
        judge("5", completion)
    assert judge._verifier._proc is None  # the math-verify process was never started



NUMERIC = [row for row in TABLE if plain_number(row[0]) is not None]


@pytest.mark.parametrize(("gold", "completion", "paid", "why"), NUMERIC,
                         ids=[f"{i:02d}-{why}" for i, (_, _, _, why) in enumerate(NUMERIC)])
def test_the_exact_answer_reward_function_decides_numbers_as_the_check_does(gold, completion, paid, why) -> None:
    """``reward_funcs=["exact_answer"]`` (TRL's shape) pays what the strict check pays."""
    assert exact_answer([""], [completion], [gold]) == [float(paid)], f"{gold!r} vs {completion!r}: {why}"
