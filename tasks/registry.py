"""Task configs (a tagged union on `kind`) and the one function that makes a task."""

from __future__ import annotations

from tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from tasks.base import Task
from tasks.countdown import CountdownConfig, CountdownTask
from tasks.jsonl import JsonlConfig, JsonlTask

# Decoded from TOML as e.g. {kind = "countdown", n_numbers = 4}.
TaskConfig = ArithmeticConfig | CountdownConfig | JsonlConfig


def make_task(config: TaskConfig) -> Task:
    """The task a config describes. A JSONL task reads (and validates) its file here."""
    if isinstance(config, ArithmeticConfig):
        return ArithmeticTask(config)
    if isinstance(config, CountdownConfig):
        return CountdownTask(config)
    if isinstance(config, JsonlConfig):
        return JsonlTask(config)
    raise TypeError(f"not a task config: {config!r}")
