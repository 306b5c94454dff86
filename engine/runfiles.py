"""The run directory: created fresh, holding the resolved config next to what the run writes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgspec

from engine.config import RunConfig


def make_run_dir(requested: str | None) -> Path:
    """``runs/<timestamp>`` by default; an existing non-empty directory is refused, never overwritten."""
    path = Path(requested) if requested else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"--run-dir {path}: directory exists and is not empty; choose another")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_resolved_config(cfg: RunConfig, run_dir: Path) -> Path:
    """config.toml: the config as resolved (defaults and --set applied); rerunnable with --config."""
    out = run_dir / "config.toml"
    out.write_bytes(msgspec.toml.encode(_drop_none(msgspec.to_builtins(cfg))))
    return out


def _drop_none(tree):
    """TOML has no null: an unset optional field is simply left out (its default is None)."""
    if isinstance(tree, dict):
        return {k: _drop_none(v) for k, v in tree.items() if v is not None}
    if isinstance(tree, list):
        return [_drop_none(v) for v in tree]
    return tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
