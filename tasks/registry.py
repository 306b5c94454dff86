"""Task configs (a tagged union on `kind`) and the one function that makes a task.

Each task module registers its class with ``@register_task(name, ConfigType)`` (tasks.base);
importing this module registers the built-in ones. Adding a task is one module, one
config Struct tagged with its name, and one line in ``TaskConfig`` below (the union TOML
decodes into).
"""

from __future__ import annotations

from tasks.arithmetic import ArithmeticConfig
from tasks.base import Task, registered_tasks
from tasks.countdown import CountdownConfig
from tasks.gym import GymConfig
from tasks.jsonl import JsonlConfig
from tasks.user import PythonConfig

# Decoded from TOML as e.g. {kind = "countdown", n_numbers = 4}.
TaskConfig = ArithmeticConfig | CountdownConfig | JsonlConfig | GymConfig | PythonConfig


def task_names() -> list[str]:
    return sorted(registered_tasks())


def make_task(config) -> Task:
    """The task a config describes. A JSONL task reads (and validates) its file here."""
    name = getattr(getattr(type(config), "__struct_config__", None), "tag", None)
    found = registered_tasks().get(name)
    if found is None or not isinstance(config, found[0]):
        raise TypeError(f"not a task config: {config!r}; registered tasks: {', '.join(task_names())}")
    return found[1](config)
