"""How a test's gloo rank process ends: the way every actor does (engine/runtime/actors.py).

After the last collective, the ranks meet at a barrier (neither tears its group down while the other
may still use it), destroy the group, and leave without interpreter teardown: at finalization gloo's
worker threads may still hold work objects (FSDP2 keeps some), and destroying them then aborts the
process with "terminate called without an active exception" (SIGABRT; seen once in CI).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave_group() -> None:
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
