"""Your own task, as Python: ``[task] kind = "python"``, ``factory = "my_tasks:make"``, ``options = {...}``.

The factory is called as ``factory(**options)`` and returns any object with

- ``problem(prompt_id) -> Problem`` and ``eval_problem(index) -> Problem`` (``tasks.base.Problem``: the question
  and its reference answer; held-out problems must never equal training ones);
- ``verify(problem, completion_text)``: a ``tasks.base.Verdict``, or a plain reward (float; a success when it
  is at least 1.0);
- optionally ``worked_solution(problem) -> str`` (the warm start's target; the reference answer otherwise)
  and ``name``.

The module is imported from the directory the run was launched from, or from anywhere on ``sys.path``
(an installed package). Example, ``my_tasks.py``::

    from tasks.base import Problem

    class Parity:
        def problem(self, i):
            return Problem(prompt_id=i, task="parity", question=f"Is {2 * i + 1} odd?", answer="yes")
        def eval_problem(self, i):
            return Problem(prompt_id=i, task="parity", question=f"Is {2 * i} odd?", answer="no")
        def verify(self, problem, text):
            return float(text.strip().lower().startswith(problem.answer))

    def make():
        return Parity()
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import msgspec

from tasks.base import Problem, Verdict, register_task


class PythonConfig(msgspec.Struct, tag="python", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """A task made by your code: ``factory`` is "module:function", called with ``options``."""

    # "module:function" that makes the task, imported from the directory you launch from (tasks/user.py has an
    # example)
    factory: str
    options: dict[str, Any] = {}  # keyword arguments passed to `factory`


@register_task("python", PythonConfig)
class PythonTask:
    """The object the factory returned, behind the Task interface (a float reward becomes a Verdict)."""

    def __init__(self, config: PythonConfig) -> None:
        self.config = config
        self._task = _call_factory(config)
        for method in ("problem", "eval_problem", "verify"):
            if not callable(getattr(self._task, method, None)):
                raise ValueError(f"factory {config.factory!r} returned {type(self._task).__name__}, which has no "
                                 f"{method}() method (see tasks/user.py)")
        self.name = str(getattr(self._task, "name", config.factory))

    def problem(self, prompt_id: int) -> Problem:
        return self._task.problem(prompt_id)

    def eval_problem(self, index: int) -> Problem:
        return self._task.eval_problem(index)

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        judged = self._task.verify(problem, completion_text)
        if isinstance(judged, Verdict):
            return judged
        reward = float(judged)
        return Verdict(reward=reward, verified=reward >= 1.0)

    def worked_solution(self, problem: Problem) -> str:
        solve = getattr(self._task, "worked_solution", None)
        return solve(problem) if callable(solve) else problem.answer


def _call_factory(config: PythonConfig):
    module_name, _, func_name = config.factory.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"factory {config.factory!r}: expected \"module:function\"")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # after the installed packages: a local file cannot shadow them
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"factory {config.factory!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise ValueError(f"factory {config.factory!r}: {module_name} has no function {func_name!r}")
    try:
        return factory(**config.options)
    except TypeError as exc:
        raise ValueError(f"factory {config.factory!r} refused options {config.options}: {exc}") from None
