"""Run config: schema (``schema``), TOML and ``--set`` loading (``load``), cross-field rules (``validate``)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.config.load import ConfigError, convert, read_tree
from engine.config.schema import ModelConfig, RunConfig, ScriptedMove, model_spec
from engine.config.validate import validate

__all__ = ["ConfigError", "ModelConfig", "RunConfig", "ScriptedMove", "cache_root", "load_run_config", "model_spec",
           "tokenizer_cache"]


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read, override, decode and validate a run config; any problem is one ConfigError."""
    tree, origin = read_tree(path, list(overrides))
    return validate(convert(tree, RunConfig, origin), origin)


def cache_root(cfg: RunConfig) -> Path:
    """Warm starts and converted tokenizers, shared by every run on the machine.

    ``run.cache_dir`` if set, else ``$MUTUAL_RL_CACHE``, else ``$XDG_CACHE_HOME/mutual_rl``
    (``~/.cache/mutual_rl`` when XDG_CACHE_HOME is unset). ``launch.py cache`` shows and clears it.
    """
    if cfg.run.cache_dir:
        return Path(cfg.run.cache_dir).expanduser()
    return default_cache_root()


def default_cache_root() -> Path:
    if os.environ.get("MUTUAL_RL_CACHE"):
        return Path(os.environ["MUTUAL_RL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "mutual_rl"


def tokenizer_cache(cfg: RunConfig) -> str:
    return str(cache_root(cfg) / "tokenizers")
