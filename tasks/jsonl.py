"""Problems from a local JSONL file: one {"prompt": ..., "answer": ...} object a line.

Answers are checked strictly by default (``answer_check = "strict"``). A reference that is a plain number
("42", "-3", "2.5", "1,234", "3/4") is matched only by the one number the completion states as its answer
(``tasks.answers.stated_number``): never by an expression that evaluates to it, nor among several candidates.
Any other reference is compared with math-verify (up to mathematical equivalence) to the completion's one answer
read where an answer may stand (``tasks.answers.strict_answer``: a ``\\boxed{}``, an ``Answer:`` line, or a number
or expression at the very end). ``answer_check = "math_verify"`` hands math-verify the whole
completion instead, which finds an answer almost anywhere ("2abc99" reads 2): lenient, and a reward to be
hacked. The file is validated when the task is made: the first bad line is one TaskFileError naming the file and
the line.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from tasks.answers import plain_number, stated_number, strict_answer
from tasks.base import Problem, Verdict, is_held_out, register_task
from tasks.bounded import BoundedVerifier



class TaskFileError(Exception):
    """A task file is missing, empty, or has a malformed line."""


class JsonlConfig(msgspec.Struct, tag="jsonl", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """A local dataset; held-out problems from `eval_path`, else a hash split of `path`."""

    path: str  # the training file: one JSON object a line with `prompt` and `answer`
    eval_path: str | None = None  # a file of held-out problems in the same format; unset = split `path` by hash
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.1  # used when no eval_path
    seed: int = 0  # shuffles the training order
    verify_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # a completion still unjudged then is wrong
    # "strict": the one answer where an answer stands (boxed, an Answer: line, the end), a number only as a number
    # (never "2 + 3" or "6 or 5" for 5); "math_verify": anywhere
    answer_check: Literal["strict", "math_verify"] = "strict"


class _Line(msgspec.Struct):
    prompt: str
    answer: str | int | float  # datasets often store numeric answers as numbers


@register_task("jsonl", JsonlConfig)
class JsonlTask:
    """Training problems in a seeded order; problem(id) cycles through them."""

    name = "jsonl"

    def __init__(self, config: JsonlConfig) -> None:
        self.config = config
        rows = read_jsonl(Path(config.path))
        if config.eval_path is not None:
            self._train, self._eval = rows, read_jsonl(Path(config.eval_path))
        else:
            self._train = [r for r in rows if not is_held_out(r[0], config.eval_fraction)]
            self._eval = [r for r in rows if is_held_out(r[0], config.eval_fraction)]
            if not self._train or not self._eval:
                raise TaskFileError(
                    f"{config.path}: {len(rows)} problems leave an empty train or held-out split; "
                    "add lines, change eval_fraction, or set eval_path"
                )
        # said once by the launcher: how many lines the hash split kept for evaluation (few, on a small file)
        self.split_note = None if config.eval_path is not None else (
            f"task: {len(self._eval)} of the {len(rows)} problems in {config.path} are held out for evaluation "
            f"(eval_fraction={config.eval_fraction:g}, by a hash of the prompt); set task.eval_path to choose them")
        self._order = list(range(len(self._train)))
        random.Random(f"jsonl:{config.seed}").shuffle(self._order)
        self._judge = AnswerJudge(config.answer_check, config.verify_timeout_s, "jsonl")

    def problem(self, prompt_id: int) -> Problem:
        prompt, answer = self._train[self._order[prompt_id % len(self._order)]]
        return Problem(prompt_id=prompt_id, task=self.name, question=prompt, answer=answer)

    def eval_problem(self, index: int) -> Problem:
        prompt, answer = self._eval[index % len(self._eval)]
        return Problem(prompt_id=index, task=self.name, question=prompt, answer=answer)

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        return self._judge(problem.answer, completion_text)

    def worked_solution(self, problem: Problem) -> str:
        return problem.answer


class AnswerJudge:
    """A free-form answer checked against the reference (module doc): math-verify bounded by ``timeout_s`` in
    any thread (``tasks.bounded``), a time-out judged wrong."""

    def __init__(self, answer_check: str, timeout_s: float, label: str) -> None:
        self.answer_check, self.timeout_s, self.label = answer_check, timeout_s, label
        self._verifier = BoundedVerifier(timeout_s)

    def __call__(self, gold: str, completion_text: str) -> Verdict:
        if self.answer_check == "strict":
            if (want := plain_number(gold.strip())) is not None:  # never math-verify: it pays "2 + 3" and "6 or 5"
                right = stated_number(completion_text) == want
                return Verdict(reward=float(right), verified=right)
            answer = strict_answer(completion_text)
            if answer is None:
                return Verdict(reward=0.0, verified=False)
            completion_text = f"${answer}$"
        correct = self._verifier.check(_gold_text(gold), completion_text)
        if correct is None and self._verifier.timeouts == 1:
            print(f"[{self.label}] a completion took over {self.timeout_s:g}s to verify: judged wrong "
                  "(further time-outs are counted, not printed)", file=sys.stderr, flush=True)
        return Verdict(reward=1.0 if correct else 0.0, verified=bool(correct), timed_out=correct is None)


def _gold_text(answer: str) -> str:
    """The reference as math-verify reads it: a bare answer is LaTeX math."""
    return answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"


def read_jsonl(path: Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs; blank lines are skipped, anything else malformed is an error."""
    if not path.is_file():
        raise TaskFileError(f"task file {path} does not exist")
    decoder = msgspec.json.Decoder(_Line)
    rows: list[tuple[str, str]] = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors write one)
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise TaskFileError(f'{path}, line {number}: expected {{"prompt": str, "answer": str}}: {exc}') from None
            except msgspec.DecodeError as exc:
                raise TaskFileError(f"{path}, line {number}: invalid JSON: {exc}") from None
            if not row.prompt.strip():
                raise TaskFileError(f"{path}, line {number}: empty prompt")
            rows.append((row.prompt, str(row.answer)))
    if not rows:
        raise TaskFileError(f"task file {path} has no problems")
    return rows
