"""Multi-digit arithmetic: "a op b", answered with the integer result.

GPT-2's BPE merges digit runs into multi-digit tokens while SentencePiece splits
every digit, so the same problems are genuinely different for the two families.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Literal

import msgspec

from tasks.answers import AnswerRule, check_solution, read_answer
from tasks.base import Problem, Verdict, is_held_out, register_task

Op = Literal["+", "-", "*"]
_INTEGER = re.compile(r"-?\d+")


class ArithmeticConfig(msgspec.Struct, tag="arithmetic", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """Two-operand integer arithmetic."""

    # fewest digits of an operand (operands are uniform over the values with min_digits..max_digits digits,
    # so 1-digit sums stay rare)
    min_digits: Annotated[int, msgspec.Meta(ge=1, le=18)] = 1
    max_digits: Annotated[int, msgspec.Meta(ge=1, le=18)] = 2  # most digits of an operand
    ops: tuple[Op, ...] = ("+",)  # the operators questions draw from: "+", "-", "*"
    non_negative: bool = True  # for "-": larger operand first, so answers have no sign
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.1  # questions held out
    # seeds the question drawn for each problem id (whether a question is held out depends on the question alone)
    seed: int = 0
    # the question as the model reads it; {expr} is "a op b" (the split is by expr, whatever the wording)
    wording: str = "{expr}"  # e.g. "What is {expr}? Answer with the number only." for an instruct model
    answer: AnswerRule = "exact"  # how the answer is read from a completion (tasks.answers)
    solution: str = "{answer}"  # a worked solution (warm start, sgt_ref), e.g. "The answer is {answer}."

    def __post_init__(self) -> None:
        check_solution(self.solution, self.answer)
        if "{expr}" not in self.wording or self.wording.count("{") != 1:
            raise ValueError(f"wording {self.wording!r} must hold {{expr}} once and no other braces")
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        if not self.ops:
            raise ValueError("ops must name at least one of '+', '-', '*'")


_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@register_task("arithmetic", ArithmeticConfig)
class ArithmeticTask:
    """Problems "a op b"; the completion is the exact integer result."""

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig) -> None:
        self.config = config
        self._eval: list[Problem] = []  # distinct held-out problems, in a fixed order
        self._eval_questions: set[str] = set()
        self._eval_draws = 0

    def problem(self, prompt_id: int) -> Problem:
        return self._draw(prompt_id, held_out=False)

    def eval_problem(self, index: int) -> Problem:
        """The index-th *distinct* held-out problem: n problems are n different questions."""
        give_up = 100 * (index + 1) + 10_000
        while len(self._eval) <= index:
            if self._eval_draws > give_up:
                raise ValueError(
                    f"arithmetic task: only {len(self._eval)} distinct held-out questions were found; ask for fewer "
                    "eval problems, or raise max_digits or eval_fraction"
                )
            p = self._draw(self._eval_draws, held_out=True)
            self._eval_draws += 1
            if p.question not in self._eval_questions:
                self._eval_questions.add(p.question)
                self._eval.append(Problem(prompt_id=len(self._eval), task=p.task, question=p.question, answer=p.answer))
        return self._eval[index]

    def _draw(self, index: int, held_out: bool) -> Problem:
        """Draw from an id-seeded stream until the question falls in the wanted split."""
        split = "eval" if held_out else "train"
        rng = random.Random(f"arithmetic:{self.config.seed}:{split}:{index}")
        while True:
            a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.config.ops)
            if op == "-" and self.config.non_negative and a < b:
                a, b = b, a
            expr = f"{a} {op} {b}"
            if is_held_out(expr, self.config.eval_fraction) == held_out:
                answer = str(_APPLY[op](a, b))
                return Problem(prompt_id=index, task=self.name, question=self.config.wording.format(expr=expr),
                               answer=answer)

    def _operand(self, rng: random.Random) -> int:
        low = 0 if self.config.min_digits == 1 else 10 ** (self.config.min_digits - 1)
        return rng.randint(low, 10**self.config.max_digits - 1)

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        """Correct iff the answer read by the config's rule (the whole completion, by default) is the integer
        result."""
        text = read_answer(self.config.answer, completion_text)
        correct = text is not None and _INTEGER.fullmatch(text) is not None and int(text) == int(problem.answer)
        return Verdict(reward=1.0 if correct else 0.0, verified=correct)

    def worked_solution(self, problem: Problem) -> str:
        return self.config.solution.format(answer=problem.answer)
