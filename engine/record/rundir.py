"""The run directory: created fresh, holding the resolved config next to everything the run writes.

Markers say how a run ended, so a directory never looks finished when it is not:
``FAILED`` (the run could not finish as asked; the reason inside) and ``INTERRUPTED``
(stopped by a signal; what was saved inside). A run that finished as asked has neither.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import msgspec

from engine.weights.places import OWNER, remove_dead_owners


def run_dir_for(requested: str | os.PathLike | None) -> Path:
    """Where a new run writes: ``requested``, or ``runs/<timestamp>`` by default; an existing non-empty directory
    is refused (FileExistsError), never overwritten. Nothing is created."""
    path = Path(requested) if requested else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"run directory {path} exists and is not empty; choose another (--run-dir, "
                              "Trainer(run_dir=...))")
    return path


def make_run_dir(requested: str | os.PathLike | None) -> Path:
    """``run_dir_for(requested)``, created."""
    path = run_dir_for(requested)
    path.mkdir(parents=True, exist_ok=True)
    return path


def announce(cfg, run_dir: Path) -> str:
    """The run dir and what goes there, said when the run starts: its checkpoints (weights and optimizer state,
    hundreds of MB for the default models) are the bulk of it, and nobody should find that out from a full disk."""
    r = cfg.run
    every = r.checkpoint_every
    when = f"every run.checkpoint_every={every} steps and at the end" if every else "at the end"
    return (f"run dir: {run_dir}\n  the run writes there: metrics, the experience log and checkpoints (each "
            f"model's weights and optimizer state, {when}; the newest run.keep_checkpoints={r.keep_checkpoints} "
            "per model kept)")


def disk_usage(path: Path) -> int:
    """Bytes ``path`` takes on disk, as du counts them (links not followed: ``latest`` is a symlink)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def said_size(run_dir: Path) -> str:
    """The run dir's size at the end of the run, its checkpoints' share beside it."""
    checkpoints = run_dir / "checkpoints"
    share = f" (checkpoints {disk_usage(checkpoints) / 1e6:.1f} MB)" if checkpoints.is_dir() else ""
    return f"run dir: {run_dir}: {disk_usage(run_dir) / 1e6:.1f} MB on disk{share}"


def write_resolved_config(cfg: msgspec.Struct, run_dir: Path) -> Path:
    """config.toml: the config as resolved (defaults and --set applied); rerunnable with --config."""
    out = run_dir / "config.toml"
    out.write_bytes(config_toml(cfg))
    return out


def config_toml(cfg: msgspec.Struct) -> bytes:
    """The config as a TOML file that ``--config`` reads back to the same config."""
    return msgspec.toml.encode(_drop_none(msgspec.to_builtins(cfg)))


def _drop_none(tree):
    """TOML has no null: an unset optional field is simply left out (its default is None)."""
    if isinstance(tree, dict):
        return {k: _drop_none(v) for k, v in tree.items() if v is not None}
    if isinstance(tree, list):
        return [_drop_none(v) for v in tree]
    return tree


def write_json(run_dir: Path, name: str, data) -> None:
    (run_dir / name).write_text(json.dumps(data, indent=1) + "\n")


def mark(run_dir: Path, marker: str, text: str) -> None:
    """Write the ``FAILED`` or ``INTERRUPTED`` marker (appending: a run may have more than one reason)."""
    with open(run_dir / marker, "a") as f:
        f.write(text.rstrip() + "\n")


def write_pids(run_dir: Path, actors) -> None:
    """pids.json: every actor's process id (a worker on another node: its pid there, 0 until it says hello)."""
    write_json(run_dir, "pids.json", {a.name: a.process.pid for a in actors})


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` (an address of this machine) now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


SOCK_DIR_PREFIX = "mrl-"  # a run's ipc sockets: tempdir/mrl-XXXX, with owner.pid naming its launcher


def make_sock_dir() -> Path:
    """A fresh folder for this launcher's ipc sockets, its owner.pid naming this process: its actors remove it
    if the launcher dies without doing so (``remove_sock_dirs``); those of a run killed whole go here."""
    remove_dead_owners(Path(tempfile.gettempdir()), f"{SOCK_DIR_PREFIX}*")
    path = Path(tempfile.mkdtemp(prefix=SOCK_DIR_PREFIX))
    (path / OWNER).write_text(str(os.getpid()))
    return path


def remove_sock_dirs(owner: int) -> None:
    """Removes the socket folders of launcher ``owner`` (an actor's last act when its launcher was killed)."""
    for path in Path(tempfile.gettempdir()).glob(f"{SOCK_DIR_PREFIX}*"):
        try:
            mine = (path / OWNER).read_text().strip() == str(owner)
        except OSError:
            continue
        if mine:
            shutil.rmtree(path, ignore_errors=True)
