"""Tasks from reasoning-gym (``pip install -e '.[rg]'``): procedural datasets, offline, each with its own scorer.

``[task] kind = "rg:basic_arithmetic"`` (or ``kind = "rg"`` with ``dataset = "basic_arithmetic"``), the
dataset's own options in ``options = {...}``. Entry k of the dataset (reasoning-gym draws it from
``seed + k``) is held out when its question hashes below ``eval_fraction`` (``tasks.base.is_held_out``), so
no held-out question is ever trained on, whatever the seed. The answer is read from the completion by the
config's rule (``tasks.answers``) and judged by the dataset's ``score_answer``: a success is a score of 1, and the
reward is 1 for a success and 0 otherwise, the measure evaluation reports. ``partial_credit = true`` pays the
scorer's own fractions instead (chain_sum pays 0.5 for "15" when the answer is 5: SmolLM2 under GRPO drifted to
such answers, its mean reward held while its exact answers fell).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any

import msgspec

from tasks.answers import AnswerRule, check_solution, read_answer
from tasks.base import Problem, Verdict, is_held_out, register_task


class GymConfig(msgspec.Struct, tag="rg", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """A reasoning-gym dataset by name, with its options passed through."""

    dataset: str  # a reasoning-gym dataset name (reasoning_gym.factory.DATASETS), e.g. "basic_arithmetic"
    options: dict[str, Any] = {}  # the dataset's own config fields, e.g. {min_terms = 2, max_terms = 2}
    answer: AnswerRule = "last_number"  # how the answer is read from a completion (tasks.answers)
    solution: str = "{answer}"  # a worked solution (warm start, sgt_ref), e.g. "The answer is {answer}."
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.1  # questions held out
    seed: int = 0  # the dataset's seed
    size: Annotated[int, msgspec.Meta(ge=10)] = 1_000_000  # entries drawn from (training ids wrap around)
    partial_credit: bool = False  # reward = the scorer's score (its partial credit) instead of 1 for a success, else 0

    def __post_init__(self) -> None:
        check_solution(self.solution, self.answer)


def gym_problem() -> str | None:
    if importlib.util.find_spec("reasoning_gym") is None:
        return "reasoning-gym tasks need the reasoning-gym package, which is not installed; pip install -e '.[rg]'"
    return None


@register_task("rg", GymConfig)
class GymTask:
    """Training problem i is the i-th entry outside the held-out split; held-out problem i the i-th inside."""

    name = "rg"

    def __init__(self, config: GymConfig) -> None:
        if problem := gym_problem():
            raise ValueError(problem)
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if config.dataset not in DATASETS:
            raise ValueError(f"reasoning-gym has no dataset {config.dataset!r} (it has {len(DATASETS)}, e.g. "
                             f"{', '.join(sorted(DATASETS)[:6])}, ...)")
        try:
            self._data = reasoning_gym.create_dataset(config.dataset, size=config.size, seed=config.seed,
                                                      **config.options)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"reasoning-gym {config.dataset!r} refused options {config.options}: {exc}") from None
        self.config, self.name = config, f"rg:{config.dataset}"
        self._split: dict[bool, list[int]] = {False: [], True: []}  # held_out -> dataset indices, in order
        self._drawn = 0
        self._entries: dict[str, dict] = {}  # question -> entry: what its scorer reads

    def problem(self, prompt_id: int) -> Problem:
        return self._problem(prompt_id, held_out=False)

    def eval_problem(self, index: int) -> Problem:
        return self._problem(index, held_out=True)

    def _problem(self, index: int, held_out: bool) -> Problem:
        found = self._split[held_out]
        while len(found) <= index and self._drawn < self.config.size:
            entry = self._data[self._drawn]
            in_split = is_held_out(entry["question"], self.config.eval_fraction)
            if not (in_split and entry["question"] in self._entries):  # held-out questions are distinct
                self._split[in_split].append(self._drawn)
                self._entries[entry["question"]] = entry
            self._drawn += 1
        if not found:
            raise ValueError(f"{self.name}: no {'held-out' if held_out else 'training'} problems in "
                             f"{self.config.size} entries; raise size or change eval_fraction")
        if held_out and len(found) <= index:
            raise ValueError(f"{self.name}: only {len(found)} held-out problems in {self.config.size} entries; "
                             "ask for fewer eval problems, or raise size or eval_fraction")
        entry = self._data[found[index % len(found)]]
        return Problem(prompt_id=index, task=self.name, question=entry["question"], answer=str(entry["answer"]))

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        entry = self._entries.get(problem.question)
        if entry is None:  # a problem this process has not drawn yet: draw it (ids are the same everywhere)
            for draw in (self.problem, self.eval_problem):
                try:
                    draw(problem.prompt_id)
                except ValueError:
                    pass
            entry = self._entries.get(problem.question)
        if entry is None:
            raise ValueError(f"{self.name}: {problem.question!r} is not a problem of this task")
        score = float(self._data.score_answer(read_answer(self.config.answer, completion_text), entry))
        verified = score >= 1.0
        return Verdict(reward=score if self.config.partial_credit else float(verified), verified=verified)

    def worked_solution(self, problem: Problem) -> str:
        return self.config.solution.format(answer=problem.answer)
