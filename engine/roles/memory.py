"""What a worker's role holds in memory, and giving it back when the role changes.

A worker that switches role (generator <-> learner rank, or to another model) must
release the old role's memory before it takes the new role's, or a GPU would have to
hold both at once. These helpers measure and release; ``engine.roles.worker`` decides
what to drop (see the role-switch section of engine/MWRA.md).

- ``held_bytes`` counts what the worker's own references keep alive: the unique
  tensor storages of its modules (parameters, buffers, gradients) and optimizers
  (AdamW moments and step counters). It is exact on any device and independent of
  the allocator, so a CPU run measures the same thing a GPU run would hold.
- ``device_bytes`` is the CUDA allocator's view (``torch.cuda.memory_allocated``):
  it also sees memory nobody references any more but that is not yet freed.
- ``process_rss`` is the whole process's resident memory, as the OS sees it: what a role switch gives
  back to the machine on a CPU (a module's storages are large allocations, returned on free).
- ``release`` collects reference cycles, then (CUDA only) returns cached blocks to
  the driver, so the next role, or another process, can allocate them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec
import psutil
import torch
from torch.distributed.tensor import DTensor

Holdable = torch.nn.Module | torch.optim.Optimizer | torch.Tensor


@dataclass
class Policy:
    """A model as a worker holds it: tokenizer (kept for the worker's life), module, and its weight version."""

    tokenizer: object
    module: torch.nn.Module
    version: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP2's parameters, their gradients and moments) by what this process holds of it."""
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(obj: Holdable) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield _local(obj)
        if obj.grad is not None:
            yield _local(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _tensors(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                yield from _tensors(p)
        for state in obj.state.values():
            yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    else:
        raise TypeError(f"held_bytes counts modules, optimizers and tensors, not {type(obj).__name__}")


def held_bytes(*objs: Holdable) -> int:
    """Bytes of the unique storages reachable from ``objs`` (tied weights and shared storages count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for obj in objs:
        for t in _tensors(obj):
            if t.is_meta:
                continue  # no memory behind it
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def device_bytes(device: torch.device | str) -> int | None:
    """Bytes the CUDA allocator has handed out on ``device``; None on any other device (not measured)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device))


def process_rss() -> int:
    """Bytes of this process resident in memory (its RSS)."""
    return psutil.Process().memory_info().rss


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc only): tensors freed on a CPU otherwise stay resident
    in the allocator's arenas, and the machine does not get the old role's memory back (nor, after a learner step
    or a generation unit, the step's activations and the unit's KV cache while the process waits for the next:
    on one host the roles' peaks then add up)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release() -> None:
    """Free what nothing references any more: cycles first, then the C heap's free pages, then (CUDA) the
    allocator's cached blocks."""
    gc.collect()
    trim_heap()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def still_alive(refs: Iterable[weakref.ref]) -> int:
    """How many of the dropped objects something still keeps alive (call after ``release``)."""
    return sum(ref() is not None for ref in refs)


class RoleSwitch(msgspec.Struct):
    """One role switch's memory, measured at three points: one ``role_switch`` line of metrics.jsonl.

    ``device_*`` are the CUDA allocator's figures, None on any other device; ``rss_*`` the process's resident
    memory (``process_rss``).
    """

    worker: str
    from_role: str
    from_model: str
    to_role: str
    to_model: str
    reused: list[str]  # what the new role keeps of the old one, e.g. ["module:gpt2"]
    released_alive: int  # dropped modules/optimizers something still keeps alive after release (want 0)
    release_s: float
    held_bytes_before: int
    held_bytes_after_release: int
    device_bytes_before: int | None
    device_bytes_after_release: int | None
    held_bytes_after_acquire: int = 0
    device_bytes_after_acquire: int | None = None
    rss_before: int = 0
    rss_after_release: int = 0
    rss_after_acquire: int = 0
