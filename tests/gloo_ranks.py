"""How a test's gloo rank processes start (``spawn_ranks``) and end: the way every actor does (engine/runtime/actors.py).

After the last collective, the ranks meet at a barrier (neither tears its group down while the other
may still use it), destroy the group, and leave without interpreter teardown: at finalization gloo's
worker threads may still hold work objects (FSDP2 keeps some), and destroying them then aborts the
process with "terminate called without an active exception" (SIGABRT; seen once in CI).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's failure raises here.

    Forked from the fork server the engine's actors use (engine/runtime/actors.py), which has torch,
    transformers and the engine loaded once per test worker: a spawned rank would import them again, some
    5 CPU-seconds a rank on this machine."""
    import engine.runtime.actors  # noqa: F401  sets the fork server's preload: torch, transformers, the engine

    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def leave_group() -> None:
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
