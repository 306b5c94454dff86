"""Where a run's weight paths meet, as the coordinator sets them up: the machine's channel root, and whether
the run broadcasts (then its board). The workers open the ends (``engine.weights.ends``).

No torch at import: the coordinator never loads it (a launcher's CPU per run); a GPU run asks it for its
device count, and a broadcasting run for its TCPStore.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER = "owner.pid"  # the coordinator's pid, in a run's channel root


def channel_root(run_id: str) -> Path:
    """Where a run's channels live (shared memory when the host has it), claimed for this process.

    A coordinator that was killed cannot remove its channels (the whole model, in RAM): the
    next run on the host removes every root whose owner is no longer alive."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    remove_dead_owners(base, "mutual-rl-*")
    root = base / f"mutual-rl-{run_id}"
    root.mkdir(parents=True, exist_ok=True)
    (root / OWNER).write_text(str(os.getpid()))
    return root


def remove_dead_owners(base: Path, pattern: str) -> None:
    """Removes the folders ``base/pattern`` whose owner.pid names a process that is gone: a run killed with every
    one of its processes (a process group's SIGKILL, the OOM killer) left them, and nobody else will."""
    for stale in base.glob(pattern):
        if not _owner_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _owner_alive(root: Path) -> bool:
    try:
        pid = int((root / OWNER).read_text())
    except (OSError, ValueError):
        return True  # no owner file (yet, or not ours) or unreadable: not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def broadcasts(cfg) -> bool:
    """``pool.weights`` of a run config, "auto" resolved on this machine: broadcast when every worker of a machine
    has a GPU of its own (NCCL cannot pair two ranks on one GPU), else the channel (the CPU path)."""
    if cfg.pool.weights != "auto":
        return cfg.pool.weights == "broadcast"
    if cfg.pool.device != "cuda":
        return False
    import torch

    return torch.cuda.device_count() >= cfg.pool.workers_per_node()


def weights_board(cfg, host: str) -> tuple[object, str]:
    """The coordinator's board (a TCPStore on ``host``) and its address when the run broadcasts; (None, "") if not."""
    if not broadcasts(cfg):
        return None, ""
    from engine.weights.broadcast import open_board

    return open_board(host)
