"""Reward functions in TRL's shape, and the task whose reward is their weighted sum (``[reward]``).

A reward function is called on a batch of completions and returns one float per completion, or None where it
abstains::

    def short_answer(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if len(c) < 80 else 0.0 for c in completions]

``prompts`` are the questions (strings) or, for a chat prompt, its turns; ``completions`` the decoded
completions, or for a chat prompt ``[{"role": "assistant", "content": text}]`` each, as TRL gives them. Every
other column of a problem's row comes as a keyword argument with one value per completion: ``answer`` (the
reference, where the task has one), ``problem`` (this project's ``Problem``) and ``completion_ids`` always, a
dataset's own columns where it has them. A function without ``**kwargs`` gets only the arguments it names.

``reward.funcs`` names them: ``"task"`` (the task's own verifier, the default: ``TaskReward``, which TRL's
trainer takes too), ``"exact_answer"`` (the
completion's one answer, read strictly, equal to the ``answer`` column), ``"module:function"`` (imported from
the directory the run was launched from, or any installed module), or ``"file:PATH"`` (a function pickled
with cloudpickle: ``mutual_rl.Trainer(reward_funcs=[f])`` writes these for functions defined in a script or a
notebook cell). The reward is the sum of each function's reward times its ``reward.weights`` entry, over the
functions that did not abstain (TRL's rule). A completion is a success (what SGT and PRP share, what the
evaluation counts) when the task's verifier accepts it, where ``"task"`` is one of the functions; otherwise
when every function that judged it gave at least 1.0; an evaluation (held-out accuracy, the warm start's stop rule)
calls only what decides the success (none of the user's functions where the answer check does). A NaN a function
returns is an error naming it (TRL sums it away as an abstention, which hides a bug), unless ``reward.nan =
"abstain"`` reads it as None; an infinity always is. An error names the function and the file:line it is defined
at (and, for an exception, the line of that file that raised it), in one line.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import os
import sys
import traceback
from typing import Any, Callable, Sequence

from tasks.answers import plain_number, stated_number, strict_answer
from tasks.base import Problem, Task, Verdict, VerifierError, task_identity, verify_safely

RewardFunction = Callable[..., Sequence[float | None]]


def exact_answer(prompts, completions, answer, **_) -> list[float | None]:
    """1.0 where the completion's one answer equals ``answer``: for a plain number, the one number it states
    (``tasks.answers.stated_number``); else its answer where one stands (``strict_answer``), as text. 0.0 where
    it does not, None where the row has no answer."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        text = _text(completion)
        if gold is None or str(gold).strip() == "":
            out.append(None)
            continue
        gold = str(gold).strip()
        if (want := plain_number(gold)) is not None:  # a number only as a number: never "2 + 3" or "6 or 5"
            out.append(float(stated_number(text) == want))
            continue
        given = strict_answer(text)
        if given is None:
            out.append(0.0)
        else:
            out.append(float(given == gold))
    return out


BUILT_IN: dict[str, RewardFunction] = {"exact_answer": exact_answer}


class TaskReward:
    """A task's own verifier as a reward function in TRL's shape (``"task"`` in ``reward.funcs``): it judges each
    completion of ``problem`` (this project's rows carry it), or in TRL's own trainer of the task's training
    problem ``prompt_id`` (a column of the dataset you give it), and keeps each verdict (a success, a time-out)."""

    __name__ = "task"

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, prompts, completions, problem=None, prompt_id=None, **_) -> list[float]:
        if problem is None:
            if prompt_id is None:
                raise TypeError("the task's reward needs a problem or a prompt_id column")
            problem = [self.task.problem(int(i)) for i in prompt_id]
        return [v.reward for v in self.verdicts(problem, [_text(c) for c in completions])]

    def verdicts(self, problems: Sequence[Problem], texts: Sequence[str],
                 errors: list[str] | None = None) -> list[Verdict]:
        return [verify_safely(self.task, p, t, errors) for p, t in zip(problems, texts)]


def _text(completion: str | list[dict[str, str]]) -> str:
    """A completion's text, as TRL gives it: a string, or a chat completion's last turn."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


class RewardLoadError(ValueError):
    """A ``reward.funcs`` entry that names nothing callable; the message says which entry and why."""


def load_reward(spec: str) -> RewardFunction:
    """The function a ``reward.funcs`` entry names (not ``"task"``, which the task provides)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    if spec.startswith("file:"):
        return _unpickle(spec.removeprefix("file:"))
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise RewardLoadError(f"reward function {spec!r}: expected \"task\", {', '.join(map(repr, BUILT_IN))}, "
                              "\"module:function\" or \"file:PATH\"")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # after the installed packages: a local file cannot shadow them
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardLoadError(f"reward function {spec!r}: cannot import {module_name!r} "
                              f"({type(exc).__name__}: {exc})") from None
    for part in name.split("."):
        found = getattr(found, part, None)
    if not callable(found):
        raise RewardLoadError(f"reward function {spec!r}: {module_name} has no function {name!r}")
    return found


def spec_identity(spec: str) -> str:
    """What a ``reward.funcs`` entry is, for cache keys: a pickled function by its bytes, not by its file's path
    (each run writes its own copy under its run directory: two runs of one script would never share a warm start);
    a name as itself."""
    if not spec.startswith("file:"):
        return spec
    try:
        with open(spec.removeprefix("file:"), "rb") as f:
            return "pickled:" + hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return spec  # not readable here: the loader says why when it is needed


def _unpickle(path: str) -> RewardFunction:
    import cloudpickle

    try:
        with open(path, "rb") as f:
            found = cloudpickle.load(f)
    except FileNotFoundError:
        raise RewardLoadError(f"reward function file:{path}: no such file") from None
    except Exception as exc:  # a function pickled where a module it needs is missing here
        raise RewardLoadError(f"reward function file:{path} does not load here ({type(exc).__name__}: {exc})") \
            from None
    if not callable(found):
        raise RewardLoadError(f"reward function file:{path} holds a {type(found).__name__}, not a function")
    return found


def reward_name(func: RewardFunction) -> str:
    """How a function's mean reward is logged (TRL's ``rewards/<name>/mean``): its ``__name__``."""
    return getattr(func, "__name__", None) or type(func).__name__


def reward_names(specs: Sequence[str]) -> list[str]:
    """The logged name of each ``reward.funcs`` entry, made unique by a suffix where two share one."""
    names = [spec if spec in ("task", *BUILT_IN) else reward_name(load_reward(spec)) for spec in specs]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def has_answers(task: Task) -> bool:
    """Whether the task's problems carry answers its check can judge (a dataset without an answer column not)."""
    return bool(getattr(task, "has_answers", True))


def success_rule(success: str | float, answers: bool) -> str | float:
    """``reward.success`` resolved: "auto" is the task's answer check where the task has answers, else "all"
    (the config's check refuses a run that counts successes with nothing to define them)."""
    if success == "auto":
        return "task" if answers else "all"
    return float(success) if isinstance(success, (int, float)) and not isinstance(success, bool) else success


class RewardedTask:
    """A task whose reward is ``reward.funcs``' weighted sum; its problems, split and solutions the task's."""

    def __init__(self, task: Task, specs: Sequence[str], weights: Sequence[float],
                 success: str | float = "auto", nan: str = "error") -> None:
        self.task, self.name, self.config = task, task.name, task.config
        self.nan_abstains = nan == "abstain"  # reward.nan: a NaN returned reads as None, not as an error
        self.specs = list(specs)
        self.funcs = {i: load_reward(s) for i, s in enumerate(self.specs) if s != "task"}  # once a process
        self.names = reward_names(self.specs)
        self.weights = list(weights) or [1.0] * len(self.specs)
        self.split_note = getattr(task, "split_note", None)
        self.success = success_rule(success, has_answers(task))
        if isinstance(self.success, str) and self.success not in ("task", "all") and self.success not in self.names:
            raise RewardLoadError(f"reward.success = {success!r}: names no reward function (they are "
                                  f"{', '.join(self.names)}); a name, \"task\", \"all\" or a number")
        # where the task's answer check decides success, caches of successes (warm starts, evaluations, which
        # call nothing else: score(only_success=True)) hold for any functions; otherwise they and the rule decide
        plain = self.success == "task"
        self.identity = task_identity(task) if plain else {
            "task": task_identity(task), "reward": [spec_identity(s) for s in self.specs], "success": self.success}

    def problem(self, prompt_id: int) -> Problem:
        return self.task.problem(prompt_id)

    def eval_problem(self, index: int) -> Problem:
        return self.task.eval_problem(index)

    def worked_solution(self, problem: Problem) -> str:
        return self.task.worked_solution(problem)

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        return self.score([problem], [completion_text])[0]

    def score(self, problems: Sequence[Problem], texts: Sequence[str], errors: list[str] | None = None,
              completion_ids: Sequence[Sequence[int]] | None = None, only_success: bool = False) -> list[Verdict]:
        """Each completion's verdict: the weighted reward, the success, each function's part (NaN: abstained).
        A function that raises or answers in the wrong shape is a VerifierError naming it, or with ``errors``
        a line there and 0 for the batch. ``only_success`` (an evaluation, which counts successes): only the
        functions the success rule reads are called (none of the user's where the task's answer check decides);
        the others' parts are NaN, and the reward is of those called alone."""
        n = len(texts)
        verdicts = None
        parts: list[list[float]] = []
        reads = self.success_reads() if only_success else set(range(len(self.specs)))
        for i, spec in enumerate(self.specs):
            if i not in reads:
                parts.append([math.nan] * n)
            elif spec == "task":
                verdicts = TaskReward(self.task).verdicts(problems, texts, errors)
                parts.append([v.reward for v in verdicts])
            else:
                parts.append(self._call(i, problems, texts, errors, completion_ids))
        if self.success == "task" and verdicts is None:  # the answer check decides success, paying nothing
            verdicts = TaskReward(self.task).verdicts(problems, texts, errors)
        out = []
        for k in range(n):
            mine = [column[k] for column in parts]
            judged = [(w, r) for w, r in zip(self.weights, mine) if not math.isnan(r)]
            reward = float(sum(w * r for w, r in judged))
            timed_out = verdicts is not None and verdicts[k].timed_out
            out.append(Verdict(reward=reward, verified=self._succeeded(mine, judged, reward, verdicts, k),
                               timed_out=timed_out, parts=tuple(mine)))
        return out

    def success_reads(self) -> set[int]:
        """The indices of ``specs`` the success rule reads: "task"'s for the answer check, the one it names, or all
        of them ("all", a threshold of the weighted reward)."""
        rule = self.success
        if rule == "task":
            return {i for i, s in enumerate(self.specs) if s == "task"}
        if isinstance(rule, str) and rule != "all":
            return {self.names.index(rule)}
        return set(range(len(self.specs)))

    def _succeeded(self, mine: list[float], judged: list, reward: float, verdicts, k: int) -> bool:
        rule = self.success
        if rule == "task":
            return verdicts[k].verified
        if rule == "all":  # every function that judged gave full marks
            return bool(judged) and all(r >= 1.0 for _, r in judged)
        if isinstance(rule, str):  # one function's full marks (an abstention is no success)
            return mine[self.names.index(rule)] >= 1.0
        return reward >= rule

    def _call(self, i: int, problems, texts, errors, completion_ids) -> list[float]:
        func, name, n = self.funcs[i], self.names[i], len(texts)
        chat = [p.messages is not None for p in problems]
        columns: dict[str, list] = {"answer": [p.answer for p in problems], "problem": list(problems),
                                    "completion_ids": [list(c) for c in completion_ids] if completion_ids else
                                    [[] for _ in texts]}
        for key in {k for p in problems for k in p.columns}:
            columns.setdefault(key, [p.columns.get(key) for p in problems])
        prompts = [p.prompt for p in problems]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        who = f"reward function {name} ({where(func)})"  # its file and line, as the Trainer's check names it
        try:
            got = func(**accepted_arguments(func, {"prompts": prompts, "completions": completions, **columns}))
            return _floats(got, n, who, self.nan_abstains)
        except Exception as exc:  # the user's code: whatever it raises is named, never a dead process
            said = (exc.args[0] if isinstance(exc, _BadShape) else
                    f"{who} raised {type(exc).__name__}: {one_line(str(exc))} at {raised_at(exc, func)}") + \
                f", on a batch of {n} completions (the first of problem {problems[0].prompt_id}: " \
                f"{problems[0].question[:60]!r})"
            if errors is None:
                raise VerifierError(said) from None
            errors.append(said)
            return [0.0] * n


class _BadShape(Exception):
    """A reward function's answer that is not one float (or None) per completion."""


def _floats(got: Any, n: int, who: str, nan_abstains: bool = False) -> list[float]:
    """``got`` as one float per completion (NaN: abstained), or a _BadShape saying what ``who`` returned."""
    try:
        if got is None or isinstance(got, (str, bytes, dict)):  # list("yes") would read as three values
            raise TypeError
        values = list(got)
    except TypeError:
        raise _BadShape(f"{who} returned {one_line(repr(got), 60)} ({type(got).__name__}), not a list of {n} floats "
                        "(None to abstain)") from None
    if len(values) != n:
        raise _BadShape(f"{who} returned {len(values)} values for {n} completions")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):  # float("1") would pay a string: a bug, not a reward
                raise TypeError
            value = float(v)
        except (TypeError, ValueError):
            raise _BadShape(f"{who} returned {one_line(repr(v), 60)} ({type(v).__name__}), not a float or None") \
                from None
        if math.isnan(value) and not nan_abstains:  # NaN means "abstain" only where the user said so
            raise _BadShape(f"{who} returned NaN, an error (reward.nan = \"error\"): return None "
                            "to abstain, or set reward.nan = \"abstain\"")
        if math.isinf(value):  # one infinite reward makes every advantage of its group NaN
            raise _BadShape(f"{who} returned {value}, not a finite float")
        out.append(value)
    return out


def where(func: Callable) -> str:
    """The file:line a function is defined at (a callable object's ``__call__``; "?" for a builtin)."""
    target = inspect.unwrap(func)
    target = getattr(target, "func", target)  # functools.partial
    # the class's __call__ for its code, not a test of callability (B004)
    code = (getattr(target, "__code__", None)
            or getattr(getattr(type(target), "__call__", None), "__code__", None))  # noqa: B004
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?"


def raised_at(exc: BaseException, func: Callable) -> str:
    """The line of the user's file an exception came from: the last frame in the function's own file (a library
    it called raised below it), else the last frame. The first frame is the caller's (the call of ``func``)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]
    if not frames:
        return "?"
    file = where(func).rpartition(":")[0]
    frame = next((f for f in reversed(frames) if f.filename == file), frames[-1])
    return f"{frame.filename}:{frame.lineno}"


def one_line(text: str, limit: int = 200) -> str:
    """A value or a message on one line, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def user_judged(task: Task) -> bool:
    """Whether a success of ``task`` is judged by a user's reward function (an evaluation calls it)."""
    return isinstance(task, RewardedTask) and any(task.specs[i] != "task" for i in task.success_reads())


def accepted_arguments(func: Callable, columns: dict[str, list]) -> dict[str, list]:
    """The keyword arguments ``func`` takes: all of them with ``**kwargs``, else those it names (TRL's functions
    take ``**kwargs``; one written for this project alone may name just ``completions`` and ``answer``)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return columns
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return columns
    named = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in named}


def score(task: Task, problems: Sequence[Problem], texts: Sequence[str], errors: list[str] | None = None,
          completion_ids: Sequence[Sequence[int]] | None = None, only_success: bool = False) -> list[Verdict]:
    """Verdicts of a batch: by the task's reward functions where it has them, else its verifier one by one.
    ``only_success``: only what decides the success is called (``RewardedTask.score``)."""
    if isinstance(task, RewardedTask):
        return task.score(problems, texts, errors, completion_ids, only_success)
    return TaskReward(task).verdicts(problems, texts, errors)
