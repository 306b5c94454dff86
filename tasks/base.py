"""What a task is: problems by id, a held-out eval set, a verifier, worked solutions."""

from __future__ import annotations

import hashlib
import traceback
from typing import Any, Callable, Protocol, TypeVar

import msgspec


class Problem(msgspec.Struct, frozen=True):
    """One prompt. The engine sends the same shape on the wire."""

    prompt_id: int  # global id: every model sees the same problem for the same id
    task: str  # name of the task that made it
    question: str  # the bare question (a chat prompt's last user turn); each model wraps it in its own template
    answer: str  # the reference answer (for countdown: the target number); "" where reward functions judge alone
    # a chat prompt ({"role", "content"} turns, a system prompt first where there is one), formatted by each
    # model's chat template; None: the question alone is the prompt
    messages: list[dict[str, str]] | None = None
    columns: dict[str, Any] = {}  # the rest of a dataset row: reward functions get each as a keyword argument

    @property
    def prompt(self) -> str | list[dict[str, str]]:
        """What a model is prompted with: the chat turns when there are some, else the question."""
        return self.messages if self.messages is not None else self.question


class Verdict(msgspec.Struct, frozen=True):
    """The verifier's judgement of one completion."""

    reward: float  # what RL maximises
    verified: bool  # the verifier confirmed the completion correct (a "success")
    timed_out: bool = False  # the verifier ran out of time (judged wrong; the engine counts these)
    parts: tuple[float, ...] = ()  # each reward function's own reward (NaN: it abstained), with reward.funcs set


class Task(Protocol):
    """A source of problems with an exact verifier."""

    name: str
    config: msgspec.Struct  # the config it was made from (hashed into warm-start cache keys)

    def problem(self, prompt_id: int) -> Problem:
        """Training problem `prompt_id`: a pure function of the id and the task's seed."""
        ...

    def eval_problem(self, index: int) -> Problem:
        """Held-out problem `index`: never equal to any training problem."""
        ...

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        """Judge `completion_text` (the decoded completion, special tokens removed)."""
        ...

    def worked_solution(self, problem: Problem) -> str:
        """A correct completion text for `problem` (the warm start's target)."""
        ...


def task_identity(task: Task) -> object:
    """What of a task decides its problems and verdicts, for cache keys (warm starts, their evaluations): its
    config, or its own ``identity`` where the config names files (a dataset: their content counts, not where
    they lie, so a notebook's run re-reads its warm start)."""
    return getattr(task, "identity", None) or task.config


class VerifierError(Exception):
    """A task's verifier raised on a completion; the message says what, where and on which problem."""


def verify_safely(task: Task, problem: Problem, text: str, errors: list[str] | None = None) -> Verdict:
    """``task.verify``, where a verifier (a user's reward function) that raises is a VerifierError naming the
    exception, its file and line and the problem; or, given ``errors``, a verdict of 0 with that line added."""
    try:
        return task.verify(problem, text)
    except Exception as exc:  # the user's code: whatever it raises is named, never a dead process
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno} (in {frames[-1].name})" if frames else ""
        said = (f"the task's verifier raised {type(exc).__name__}: {exc}{where}, judging problem {problem.prompt_id} "
                f"({problem.question[:80]!r})")
        if errors is None:
            raise VerifierError(said) from None
        errors.append(said)
        return Verdict(reward=0.0, verified=False)


def stable_fraction(text: str) -> float:
    """A hash of `text` mapped to [0, 1): the same in every process and on every run.

    (Python's hash() is salted per process, so it cannot split train from eval.)"""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def is_held_out(question: str, eval_fraction: float) -> bool:
    """Whether `question` belongs to the held-out split (the same answer everywhere)."""
    return stable_fraction(question) < eval_fraction


# --- the registry: a config's ``kind`` names the task class that reads it ---

_REGISTRY: dict[str, tuple[type[msgspec.Struct], Callable[[msgspec.Struct], Task]]] = {}
T = TypeVar("T")


def register_task(name: str, config_type: type[msgspec.Struct]) -> Callable[[T], T]:
    """Class decorator: the task made from ``config_type`` (tagged ``name``); a duplicate name is refused."""
    tag = getattr(getattr(config_type, "__struct_config__", None), "tag", None)
    if tag != name:
        raise ValueError(f"task {name!r}: config type {config_type.__name__} must be tagged {name!r}, found {tag!r}")

    def decorate(cls: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} is already registered (by {_REGISTRY[name][1].__qualname__})")
        _REGISTRY[name] = (config_type, cls)
        return cls

    return decorate


def registered_tasks() -> dict[str, tuple[type[msgspec.Struct], Callable[[msgspec.Struct], Task]]]:
    return dict(_REGISTRY)
