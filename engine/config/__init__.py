"""Run config: schema (``schema``), TOML and ``--set`` loading (``load``), cross-field rules (``validate``)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from tokenbridge.cachedir import default_cache_root
from engine.config.load import ConfigError, Origin, convert, read_tree
from engine.config.schema import ModelConfig, RunConfig, ScriptedMove, cache_root, model_spec
from engine.config.validate import validate

__all__ = ["ConfigError", "ModelConfig", "Origin", "RunConfig", "ScriptedMove", "cache_root", "config_from_tree", "default_cache_root",
           "load_run_config", "model_spec", "tokenizer_cache"]


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read, override, decode and validate a run config; any problem is one ConfigError."""
    return config_from_tree(*read_tree(path, list(overrides)))


def config_from_tree(tree: dict, origin: Origin, check_machine: bool = True, quiet: bool = False) -> RunConfig:
    """Decode and validate a parsed config tree; ``check_machine=False`` skips what depends on this machine
    (checkpoint dirs, a CUDA device): an experiment's ``--dry-run`` plans runs for another machine."""
    _gym_shorthand(tree)
    for section, switch in (("objective", _switch_objective), ("task", _switch_task)):
        dropped = switch(tree, origin)
        if dropped and not quiet:
            kind = tree[section]["kind"]
            print(f"note: {origin.of(section + '.kind')}: ignoring {origin.file}'s {section} {', '.join(dropped)} "
                  f"(not a {kind} setting)", file=sys.stderr)
    if (said := _pretrained_length(tree)) and not quiet:
        print(said, file=sys.stderr)
    return validate(convert(tree, RunConfig, origin), origin, check_machine)


PRETRAINED_MAX_NEW_TOKENS = 256  # TRL's max_completion_length: room for a pretrained model's worked answer


def _pretrained_length(tree: dict) -> str | None:
    """A run with a pretrained checkpoint and no ``train.max_new_tokens`` samples up to 256 tokens, not the
    12 that fit the small from-scratch models' bare answers (a pretrained model works its answer out in
    words, and a cap that cuts it off reads as a wrong answer). Returns the note said, or None."""
    models, train = tree.get("models"), tree.get("train", {})
    if not isinstance(models, list) or not isinstance(train, dict) or "max_new_tokens" in train:
        return None
    if not any(isinstance(m, dict) and m.get("checkpoint") for m in models):
        return None
    tree["train"] = {**train, "max_new_tokens": PRETRAINED_MAX_NEW_TOKENS}
    return (f"note: train.max_new_tokens = {PRETRAINED_MAX_NEW_TOKENS}, the default when a model starts from a "
            "checkpoint (12 for models built from scratch); set it to change")


def _gym_shorthand(tree: dict) -> None:
    """``[task] kind = "rg:NAME"`` is ``kind = "rg"`` with ``dataset = "NAME"`` (``tasks.gym``)."""
    table = tree.get("task")
    kind = table.get("kind") if isinstance(table, dict) else None
    if isinstance(kind, str) and kind.startswith("rg:"):
        table["kind"] = "rg"
        table.setdefault("dataset", kind[3:])


def _switch_objective(tree: dict, origin: Origin) -> list[str]:
    """``--set objective.kind=grpo`` on a file written for another kind: the file's fields that only
    the other kind has (sgt's ``lambda``) are dropped, and we say so. A flag's own fields are kept,
    so a misplaced ``--set objective.lambda=...`` is still an error that names the flag."""
    table = tree.get("objective")
    if not isinstance(table, dict) or origin.of("objective.kind") == origin.file:
        return []
    from policies.registry import get_objective  # torch: only when a flag switched the kind

    try:
        config_type, _ = get_objective(str(table.get("kind")))
    except KeyError:
        return []  # the decoder names the unknown kind
    return _drop_foreign(table, "objective", config_type, origin)


def _switch_task(tree: dict, origin: Origin) -> list[str]:
    """``--set task.kind=jsonl`` on a file written for another task: as ``_switch_objective``, the file's fields
    that the new kind lacks (arithmetic's ``min_digits``) are dropped and said."""
    table = tree.get("task")
    if not isinstance(table, dict) or origin.of("task.kind") == origin.file:
        return []
    from tasks.registry import registered_tasks

    found = registered_tasks().get(str(table.get("kind")))
    return [] if found is None else _drop_foreign(table, "task", found[0], origin)


def _drop_foreign(table: dict, section: str, config_type: type, origin: Origin) -> list[str]:
    """Removes the file's keys of ``table`` that ``config_type`` does not have; returns them."""
    known = {f.encode_name for f in msgspec.structs.fields(config_type)} | {"kind"}
    dropped = [k for k in table if k not in known and origin.of(f"{section}.{k}") == origin.file]
    for key in dropped:
        del table[key]
    return dropped


def tokenizer_cache(cfg: RunConfig) -> str:
    return str(cache_root(cfg) / "tokenizers")


def run_task(cfg: RunConfig):
    """The run's task with its reward as the config says: functions, weights, what a NaN is, what a success is."""
    from tasks.registry import make_task

    r = cfg.reward
    return make_task(cfg.task, r.funcs, r.weights, r.success, r.nan)
