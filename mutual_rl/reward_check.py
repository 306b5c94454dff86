"""Reward functions checked when a ``Trainer`` is built, so that a broken one is refused in one line before any
process starts, not minutes later in a generator: its signature against the arguments it will get, then one dry
call on the first rows of the training data, each completion the row's reference answer (one a function must
handle). What it returns must be one real number or None per completion; a NaN only where ``reward.nan =
"abstain"``. Each problem is one ConfigError naming the function and its file:line.

Where the rows are not at hand (a config's task read from a file), nothing is checked here: the run's own checks
(``tasks.rewards``) name a bad function when it is first called.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

from engine.config import ConfigError, RunConfig
from tasks.base import Problem
from tasks.rewards import (BUILT_IN, RewardLoadError, accepted_arguments, load_reward, one_line, raised_at,
                           reward_name, where)

ROWS = 4  # rows of the dry call: enough to catch a length that does not follow the batch
ALWAYS = ("prompts", "completions", "completion_ids", "problem", "answer")  # what every function may take


def check_rewards(cfg: RunConfig, inputs: Any) -> None:
    """Each user function of ``cfg.reward.funcs`` (``inputs``: the Trainer's ``Inputs``, whose callables are
    checked as given, not as pickled), or a ConfigError."""
    prefix = "Trainer(reward_funcs=...)" if inputs.funcs else "reward.funcs"
    funcs = _user_functions(cfg, inputs, prefix)
    if not funcs:
        return
    problems, source = _sample(cfg, inputs, prefix)
    if not problems:
        return
    given = _arguments(problems)
    allow = 'pass reward_nan="abstain"' if inputs.funcs else 'set reward.nan = "abstain"'
    for func in funcs:
        said = _signature_problem(func, given) or _call_problem(func, given, cfg.reward.nan, allow, source)
        if said:
            raise ConfigError(f"{prefix}: {reward_name(func)} ({where(func)}) {said}")


def _user_functions(cfg: RunConfig, inputs: Any, prefix: str) -> list[Callable]:
    """The functions of ``reward.funcs`` that are the user's: not "task" nor a built-in one."""
    out = []
    for spec in cfg.reward.funcs:
        if spec in inputs.callables:
            out.append(inputs.callables[spec])
        elif spec != "task" and spec not in BUILT_IN:
            try:
                out.append(load_reward(spec))
            except RewardLoadError as exc:  # as the run's pre-flight says it, only sooner
                raise ConfigError(f"{prefix}: {exc}") from None
    return out


def _sample(cfg: RunConfig, inputs: Any, prefix: str) -> tuple[list[Problem], str]:
    """The first rows as the run's problems, and how to say where they came from; none where reading them would
    cost more than the check is worth (a task from a file: the run reads it once, in its pre-flight)."""
    from tasks.arithmetic import ArithmeticConfig
    from tasks.countdown import CountdownConfig
    from tasks.dataset import DatasetConfig, DatasetTask
    from tasks.jsonl import TaskFileError

    ds = inputs.datasets.get("train_dataset")
    if ds is not None and isinstance(cfg.task, DatasetConfig):
        rows = ds.select(range(min(ROWS, len(ds)))).to_list()
        maker = object.__new__(DatasetTask)  # its _problem_of reads the config alone: the run's problems exactly
        maker.config = cfg.task
        try:
            problems = [maker._problem_of(row, i, f"row {i}") for i, row in enumerate(rows)]
        except TaskFileError as exc:
            raise ConfigError(f"Trainer(train_dataset=...): {exc}") from None
        return problems, f"the first {len(rows)} rows of train_dataset"
    if isinstance(cfg.task, (ArithmeticConfig, CountdownConfig)):  # made, not read: cheap
        from tasks.registry import make_task

        task = make_task(cfg.task)
        return [task.problem(i) for i in range(ROWS)], f"{ROWS} problems of the {task.name} task"
    return [], ""


def _arguments(problems: list[Problem]) -> dict[str, list]:
    """The keyword arguments of a batch, one completion per problem (its answer), as ``RewardedTask._call``
    builds them in the run."""
    texts = [p.answer for p in problems]
    args: dict[str, list] = {
        "prompts": [p.prompt for p in problems],
        "completions": [[{"role": "assistant", "content": t}] if p.messages is not None else t
                        for p, t in zip(problems, texts)],
        "answer": texts, "problem": list(problems),
        "completion_ids": [list(t.encode()) for t in texts]}  # token ids in the run; one per byte here
    for key in {k for p in problems for k in p.columns}:
        args.setdefault(key, [p.columns.get(key) for p in problems])
    return args


def _signature_problem(func: Callable, given: dict[str, list]) -> str | None:
    """What the function needs that it will not get: a parameter without a default that names no argument."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: its dry call says what is wrong
        return None
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and (
        p.kind is inspect.Parameter.POSITIONAL_ONLY or
        (p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) and p.name not in given))]
    if not missing:
        return None
    return (f"takes {', '.join(missing)}, which it will not be given (arguments come by keyword: "
            f"{', '.join([*ALWAYS, *sorted(set(given) - set(ALWAYS))])}); give {missing[0]} a default, or add a "
            "column of that name to the dataset")


def _call_problem(func: Callable, given: dict[str, list], nan: str, allow: str, source: str) -> str | None:
    """What is wrong with one call on the batch ``given``: what it raised, or what it returned (``allow``: how to
    let a NaN abstain)."""
    try:
        got = func(**accepted_arguments(func, given))
    except Exception as exc:  # the user's code: whatever it raises is the answer
        return f"raised {type(exc).__name__}: {one_line(str(exc))} at {raised_at(exc, func)}, {_dry(source)}"
    said = _result_problem(got, len(given["completions"]), nan == "abstain", allow)
    return f"{said}, {_dry(source)}" if said else None


def _result_problem(got: Any, n: int, nan_abstains: bool, allow: str) -> str | None:
    """Why ``got`` is not one real number (or None) for each of ``n`` completions, or None."""
    if hasattr(got, "tolist") and not isinstance(got, (list, tuple)):  # a numpy array, a torch tensor
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        return f"returned {_shown(got)} ({type(got).__name__}), not a list of {n} floats (None to abstain)"
    if len(got) != n:
        return f"returned {len(got)} values for {n} completions (one each, None to abstain)"
    for k, v in enumerate(got):
        if v is None:
            continue
        if not _real(v):
            return f"returned {_shown(v)} ({type(v).__name__}) for completion {k}, not a float or None"
        value = float(v)
        if math.isnan(value) and not nan_abstains:
            return (f"returned NaN for completion {k}: NaN is an error, not an abstention (return None to abstain, "
                    f"or {allow} to read NaN as None)")
        if math.isinf(value):
            return f"returned {value} for completion {k}, not a finite float"
    return None


def _real(v: Any) -> bool:
    """An int, float or bool, Python's or numpy's (a 0-d array or tensor too), not a complex or a string."""
    if isinstance(v, numbers.Real):
        return True
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # numpy.bool_, a 0-d tensor
        return isinstance(v.item(), numbers.Real)
    return False


def _dry(source: str) -> str:
    return f"on a dry call with {source}, each completion the reference answer"


def _shown(v: Any) -> str:
    return one_line(repr(v))
