"""Learner -> generator weights over a torch.distributed group: broadcast bucket by bucket.

The path across GPUs and hosts, where the shared-memory channel (``channel.py``) cannot go:
NCCL between GPUs, gloo on CPUs (how it is tested); the engine uses it over one pair group per
leader and generator (``broadcast``). The learner's rank ``src`` casts its tensors to the
generators' dtype and broadcasts them in buckets of at most ``bucket_bytes``, each one flat
tensor of one dtype: a few large collectives instead of one per parameter, and bounded extra
memory on both sides. A receiver takes every bucket before it copies any into its tensors.
``manifest`` names a bucket as sglang's ``update_weights_from_distributed``
request does, but the framing here (a header, then one flat tensor per bucket) is this
module's own: an sglang generator expects its own framing (one broadcast per tensor, or its
``flattened_bucket`` format), which is not written yet.

A header ``[version, buckets, bytes]`` goes first, so a receiver whose tensors do not match
the sender's plan fails at once instead of mis-assigning bytes. The group's time-out bounds
every collective: a peer that died is one ``WeightSyncError``, never a hang.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from engine.weights.channel import WeightSyncError  # one error for every weight path: the plans differ, a peer died

NamedTensors = list[tuple[str, torch.Tensor]]
BUCKET_BYTES = 256 << 20  # large enough that NCCL runs near its bandwidth, small next to a GPU's memory


def _collective(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except WeightSyncError:
            raise
        except Exception as exc:  # gloo and NCCL report a dead peer with several types
            raise WeightSyncError(f"weight sync ({fn.__name__.removesuffix('_packed')}) failed: {exc}") from exc

    return wrapped


def plan(named: NamedTensors, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES) -> list[NamedTensors]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes`` on the wire (a larger tensor alone)."""
    buckets: list[NamedTensors] = [[]]
    size, width = 0, torch.empty((), dtype=dtype).element_size()
    for name, t in named:
        nbytes = t.numel() * width
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return [b for b in buckets if b]


def manifest(bucket: NamedTensors, dtype: torch.dtype) -> dict:
    """A bucket as sglang's update_weights_from_distributed names it."""
    return {"names": [n for n, _ in bucket], "dtypes": [str(dtype).removeprefix("torch.")] * len(bucket),
            "shapes": [list(t.shape) for _, t in bucket]}


def _header(version: int, buckets: list[NamedTensors], dtype: torch.dtype) -> torch.Tensor:
    nbytes = sum(t.numel() for b in buckets for _, t in b) * torch.empty((), dtype=dtype).element_size()
    return torch.tensor([version, len(buckets), nbytes], dtype=torch.int64)


def _broadcast(t: torch.Tensor, src: int, group) -> None:
    """``dist.broadcast`` over the default group, or over a standalone pair group (``engine.weights.broadcast``),
    which is not registered with torch.distributed's world and is called directly (``src`` is its own rank)."""
    if group is None:
        dist.broadcast(t, src=src)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([t], opts).wait()


def pack(named: NamedTensors, dtype: torch.dtype, device: torch.device | str = "cpu",
         bucket_bytes: int = BUCKET_BYTES) -> list[torch.Tensor]:
    """``named`` as the flat buckets ``send_packed`` sends: a snapshot that later optimizer steps do not change."""
    with torch.no_grad():
        return [torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for _, t in bucket])
                for bucket in plan(named, dtype, bucket_bytes)]


@_collective
def send_packed(flats: list[torch.Tensor], version: int, src: int, group=None) -> int:
    """Broadcast buckets ``pack`` made, after their header; returns the bytes sent."""
    nbytes = sum(f.numel() * f.element_size() for f in flats)
    header = torch.tensor([version, len(flats), nbytes], dtype=torch.int64, device=flats[0].device)
    _broadcast(header, src, group)
    for flat in flats:
        _broadcast(flat, src, group)
    return nbytes


def send(named: NamedTensors, version: int, src: int, dtype: torch.dtype, device: torch.device | str = "cpu",
         group=None, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Broadcast ``named`` from this rank (``src``) in ``dtype``; returns the bytes sent."""
    return send_packed(pack(named, dtype, device, bucket_bytes), version, src, group)


@_collective
def receive(named: NamedTensors, src: int, dtype: torch.dtype, device: torch.device | str = "cpu",
            group=None, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Receive a sync into ``named``'s tensors (same names and shapes as the sender's); returns its version.

    Every bucket arrives before any tensor changes: a sender that dies mid-sync leaves the old
    weights whole (at the cost of one copy of the weights in flight)."""
    buckets = plan(named, dtype, bucket_bytes)
    mine = _header(0, buckets, dtype)
    header = torch.zeros(3, dtype=torch.int64, device=device)
    _broadcast(header, src, group)
    header = header.cpu()
    if header[1:].tolist() != mine[1:].tolist():
        raise WeightSyncError(f"the sender plans {int(header[1])} buckets of {int(header[2])} bytes, this receiver "
                              f"{int(mine[1])} of {int(mine[2])}: not the same model, dtype or bucket size")
    flats = [torch.empty(sum(t.numel() for _, t in bucket), dtype=dtype, device=device) for bucket in buckets]
    for flat in flats:
        _broadcast(flat, src, group)
    with torch.no_grad():
        for bucket, flat in zip(buckets, flats):
            offset = 0
            for _, t in bucket:
                t.copy_(flat[offset: offset + t.numel()].view(t.shape))
                offset += t.numel()
    return int(header[0])
