"""Task configs (a tagged union on `kind`) and the one function that makes a task.

Each task module registers its class with ``@register_task(name, ConfigType)`` (tasks.base);
importing this module registers the built-in ones. Adding a task is one module, one
config Struct tagged with its name, and one line in ``TaskConfig`` below (the union TOML
decodes into).
"""

from __future__ import annotations

from typing import Sequence

from tasks.arithmetic import ArithmeticConfig
from tasks.base import Task, registered_tasks
from tasks.countdown import CountdownConfig
from tasks.dataset import DatasetConfig
from tasks.gym import GymConfig
from tasks.jsonl import JsonlConfig
from tasks.rewards import RewardedTask
from tasks.user import PythonConfig

# Decoded from TOML as e.g. {kind = "countdown", n_numbers = 4}.
TaskConfig = ArithmeticConfig | CountdownConfig | JsonlConfig | DatasetConfig | GymConfig | PythonConfig


def task_names() -> list[str]:
    return sorted(registered_tasks())


def make_task(config, reward_funcs: Sequence[str] = ("task",), reward_weights: Sequence[float] = (),
              success: str | float = "auto", nan: str = "error") -> Task:
    """The task a config describes, its reward ``reward_funcs``' weighted sum (``tasks.rewards``; by default the
    task's own verifier), a success as ``success`` says and a NaN as ``nan`` (``reward.success``, ``reward.nan``;
    ``engine.config.run_task`` passes a run config's). A JSONL task reads (and validates)
    its file here; a reward function is loaded here."""
    name = getattr(getattr(type(config), "__struct_config__", None), "tag", None)
    found = registered_tasks().get(name)
    if found is None or not isinstance(config, found[0]):
        raise TypeError(f"not a task config: {config!r}; registered tasks: {', '.join(task_names())}")
    task = found[1](config)
    if list(reward_funcs) == ["task"] and all(w == 1.0 for w in reward_weights) and success in ("auto", "task"):
        return task
    return RewardedTask(task, reward_funcs, reward_weights, success, nan)
