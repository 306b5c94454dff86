"""``Trainer``: one run (every model of a config, trained together) from Python, as ``launch.py run`` does it.

The config comes from a TOML file, a dict shaped like one, or a ``RunConfig``, and keyword arguments name whole
sections to change (``train={"steps": 20}``), checked as the file is, each error one line naming the argument.
``train()`` runs the warm starts, the RL phase, the final evaluations and the report in this process's
children, and returns a ``TrainResult``. From a script it runs on this thread; inside a running event loop (a
notebook) on a thread of its own, while this one waits: Ctrl-C (a notebook's interrupt) stops the run as in a
terminal, with checkpoints and final evaluations, and ``train()`` returns what was trained. Callbacks see each
learner step, each evaluation and the end as typed records, and may stop the run (``mutual_rl.callbacks``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import msgspec

from engine.config import ConfigError, RunConfig, config_from_tree
from engine.config.load import Origin, config_path, read_toml
from engine.config.trl_names import TRL_NAMES, trl_hint
from mutual_rl.callbacks import CALLBACK_ERRORS, Callback, Callbacks
from mutual_rl.inputs import Inputs
from mutual_rl.reward_check import check_rewards
from mutual_rl.runs import ModelResult, TrainResult, new_run, resumed_run, save_model

__all__ = ["ModelResult", "TrainResult", "Trainer", "TrainingFailed", "make_config", "resume", "save_model"]


class TrainingFailed(RuntimeError):
    """``train(raise_on_failure=True)``'s error for a run that failed; ``result`` is what ``train`` returns."""

    def __init__(self, message: str, result: TrainResult) -> None:
        super().__init__(message)
        self.result = result


class Trainer:
    """Trains the models of a config together: ``Trainer("smoke", train={"steps": 20}).train()``.

    ``config``: a TOML path, a shipped config's name ("smoke"), a dict of sections, or a ``RunConfig``;
    ``run_dir``: where the run writes (default runs/<timestamp>); ``callbacks``: ``TrainerCallback``s (hooks on
    each step, evaluation and the end, which may stop the run) or functions called with each record
    (``mutual_rl.callbacks``); ``callback_errors``: a hook that raises stops the run ("stop", the default) or not
    ("ignore"); ``quiet``: no live display; ``reward_nan``: ``reward.nan``, what a NaN from a reward function is
    ("error" by default, "abstain"); ``success``: ``reward.success``, what counts
    as a success (held-out accuracy, SGT, the warm start): by default the task's answer check where the dataset
    has answers; a reward function's name, a number the weighted reward must reach, or a function of TRL's shape
    whose full marks (1.0) are one (it pays nothing); ``sections``: whole config sections,
    merged into the config's (a dict into a table, anything else replacing it). A keyword of TRL's
    (``learning_rate=``, ``output_dir=``, ``args=``) is refused in one line naming its equivalent here."""

    def __init__(self, config: str | Path | dict | RunConfig | None = None, *, run_dir: str | Path | None = None,
                 callbacks: list[Callback] = (), callback_errors: str = "stop", quiet: bool = False,
                 reward_funcs: Any = None, reward_weights: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 reward_nan: str | None = None, success: Any = None, **sections: Any) -> None:
        if callback_errors not in CALLBACK_ERRORS:
            raise ConfigError(f"Trainer(callback_errors={callback_errors!r}): expected one of "
                              f"{', '.join(map(repr, CALLBACK_ERRORS))}")
        self.inputs = Inputs(reward_funcs, reward_weights, train_dataset, eval_dataset, reward_nan, success)
        self.config = make_config(config, sections, self.inputs)
        check_rewards(self.config, self.inputs)  # a broken function refused now, not in a generator minutes later
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.callbacks, self.quiet = Callbacks(callbacks, callback_errors), quiet

    def train(self, *, raise_on_failure: bool = False) -> TrainResult:
        """The whole run: warm starts, RL, final evaluations, the report (``mutual_rl.runs.new_run``). A config the
        machine refuses (a tokenizer that does not load, a run directory that exists, an estimated peak memory past
        what is available) is one ConfigError before anything runs; ``raise_on_failure``: a run that failed raises
        ``TrainingFailed`` instead of returning."""
        _, result = new_run(self.config, self.run_dir, inputs=self.inputs, quiet=self.quiet,
                            watch=self.callbacks if self.callbacks.callbacks else None)
        self.trained_dir = result.run_dir
        if raise_on_failure and result.status == "failed":  # for scripts that must not carry on after one
            raise TrainingFailed(result.error or "the run failed", result)
        return result

    def save_model(self, output_dir: str | Path, model: str | None = None) -> list[Path]:
        """TRL's ``trainer.save_model(dir)``: the last ``train()``'s final models into ``output_dir``
        (``save_model`` of this module says where each goes); the run keeps its own in ``RUN_DIR/final/``."""
        if getattr(self, "trained_dir", None) is None:
            raise ConfigError("save_model(): nothing trained yet; call train() first")
        return save_model(self.trained_dir, output_dir, model)


def resume(run_dir: str | Path, *, callbacks: list[Callback] = (), callback_errors: str = "stop",
           quiet: bool = False, **changes: Any) -> TrainResult:
    """Continue a stopped, failed or killed run, as ``launch.py resume``; ``changes`` are dotted keys of what
    may change (``**{"train.steps": 800}``)."""
    watch = Callbacks(callbacks, callback_errors)
    _, result = resumed_run(Path(run_dir), [f"{k}={_toml(v)}" for k, v in changes.items()], quiet=quiet,
                            watch=watch if watch.callbacks else None)
    return result


def make_config(config: str | Path | dict | RunConfig | None, sections: dict[str, Any],
                inputs: Inputs | None = None) -> RunConfig:
    """A validated RunConfig from what ``Trainer`` was given; any problem is one ConfigError."""
    if isinstance(config, RunConfig):
        tree, where = msgspec.to_builtins(config), "the RunConfig given"
    elif isinstance(config, dict):
        tree, where = copy.deepcopy(config), "the config dict given"
    elif config is None:
        tree, where = {}, "Trainer()"
    else:
        path = config_path(config)  # a path, or a shipped config's name ("smoke")
        tree, where = read_toml(path), str(path)
    applied = []
    for key, value in sections.items():
        if key not in RunConfig.__struct_fields__ and (said := _trl_keyword(key, value)):
            raise ConfigError(said)
        if isinstance(value, msgspec.Struct):
            value = msgspec.to_builtins(value)
        label = f"Trainer({key}={value!r})"
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **copy.deepcopy(value)}
            # the keys given are the argument's, the rest still the config's: a kind switched here drops the
            # config's fields of the other kind, as --set does (engine.config._switch_objective)
            applied += [([key, k], label) for k in value]
        else:
            tree[key] = copy.deepcopy(value)
            applied.append(([key], label))
    if inputs is not None:
        applied += inputs.apply(tree, sections)
    return config_from_tree(tree, Origin(where, applied))


_ARGUMENTS = ("run_dir", "quiet", "callbacks", "callback_errors", "reward_funcs", "reward_weights", "train_dataset",
              "eval_dataset")


def _trl_keyword(key: str, value: Any) -> str | None:
    """The error for a keyword of TRL's (``learning_rate=``, ``output_dir=``, ``args=``) that is no argument of
    ``Trainer``: its name here, written as the keyword to pass where there is one; None for any other keyword."""
    said = trl_hint(key)
    if said is None:
        return None
    here = TRL_NAMES[key].here or ""
    section, _, field = here.partition(".")
    shown = repr(value) if len(repr(value)) <= 40 else "..."
    if section in RunConfig.__struct_fields__ and field.isidentifier():
        said += f": Trainer(..., {section}={{{field!r}: {shown}}})"
    elif here in _ARGUMENTS:
        said += f": Trainer(..., {here}={shown})"
    return f"Trainer({key}=...): not an argument of Trainer; {said}"


def _toml(value: Any) -> str:
    """A value as the TOML literal ``--set`` reads."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)

