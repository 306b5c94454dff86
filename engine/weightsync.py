"""Weight sync from a learner to its generators over torch.distributed.

One process group per model: the learner is rank 0, its generators ranks 1..n
(gloo on CPU, NCCL when the tensors live on a GPU). A sync is a broadcast of a
header ``[version, n_buckets]`` followed by the parameters packed into flat
buckets of at most ``bucket_bytes``.

Invariants (why nobody hangs and nobody trains on mixed weights):
- The learner never blocks on its generators: ``WeightSender.publish`` copies the
  parameters into a staging snapshot and returns; a background thread broadcasts
  the *newest* snapshot whenever it is newer than the last one sent.
- A generator joins a broadcast only at a batch boundary and only when it has
  been told (``WeightsReady``) of a version newer than its own. Since every
  announced version is newer than the last one sent, the sender thread is always
  there to meet it; the version in the header says what actually arrived.
- Every collective carries the group's time-out: a peer that died makes the
  other side fail loudly with ``WeightSyncError`` instead of hanging.
"""

from __future__ import annotations

import datetime
import threading
from typing import Iterable

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 32 << 20


class WeightSyncError(RuntimeError):
    """A weight broadcast failed or timed out (the peer process likely died)."""


def init_group(endpoint: str, rank: int, world_size: int, timeout_s: float, backend: str = "gloo") -> None:
    """Join this model's weight-sync group (blocks until all ranks joined or time-out)."""
    try:
        dist.init_process_group(
            backend,
            init_method=endpoint,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # torch raises several unrelated types here
        raise WeightSyncError(
            f"could not form the weight-sync group at {endpoint} as rank {rank}/{world_size} "
            f"within {timeout_s:.0f}s: {exc}"
        ) from exc


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _bucket_layout(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of params per bucket; a param larger than a bucket gets its own."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


class _FlatBuckets:
    """Preallocated flat buffers mirroring a list of same-dtype parameters."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"weight sync expects one dtype for all parameters, got {sorted(map(str, dtypes))}")
        self.layout = _bucket_layout(params, bucket_bytes)
        self.buffers = [
            torch.empty(sum(params[i].numel() for i in idx), dtype=params[0].dtype, device=params[0].device)
            for idx in self.layout
        ]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers)

    def pack(self, params: list[torch.Tensor]) -> None:
        for idx, buf in zip(self.layout, self.buffers):
            torch.cat([params[i].detach().reshape(-1) for i in idx], out=buf)

    def unpack(self, params: list[torch.Tensor]) -> None:
        for idx, buf in zip(self.layout, self.buffers):
            offset = 0
            for i in idx:
                n = params[i].numel()
                params[i].data.copy_(buf[offset : offset + n].view_as(params[i]))
                offset += n


def _sync_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters in a stable order, tied weights counted once."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class WeightSender:
    """Learner side (rank 0): snapshot on publish, broadcast in a background thread."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._params = _sync_params(model)
        self._staging = _FlatBuckets(self._params, bucket_bytes)
        self._wire = _FlatBuckets(self._params, bucket_bytes)
        self._cond = threading.Condition()
        self._staged_version = -1
        self._sent_version = -1
        self._closed = False
        self.error: BaseException | None = None
        self.broadcasts = 0
        self._thread = threading.Thread(target=self._loop, name="weight-sender", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return self._staging.nbytes

    def publish(self, version: int) -> None:
        """Stage the current parameters as ``version``; returns at once."""
        if self.error is not None:
            raise WeightSyncError(f"weight broadcast failed earlier: {self.error}") from self.error
        with self._cond:
            self._staging.pack(self._params)
            self._staged_version = version
            self._cond.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or self._staged_version > self._sent_version)
                    if self._closed:
                        return
                    version = self._staged_version
                    # Swap, don't copy: publish() packs into the other buffer while this one is on the wire.
                    self._staging, self._wire = self._wire, self._staging
                _broadcast_buffers(self._wire.buffers, version)
                self._sent_version = version
                self.broadcasts += 1
        except BaseException as exc:  # surfaced on the next publish()
            self.error = exc

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def _broadcast_buffers(buffers: Iterable[torch.Tensor], version: int) -> None:
    buffers = list(buffers)
    header = torch.tensor([version, len(buffers)], dtype=torch.int64)
    dist.broadcast(header, src=0)
    for buf in buffers:
        dist.broadcast(buf, src=0)


class WeightReceiver:
    """Generator side: join the next broadcast and load it into the model."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._params = _sync_params(model)
        self._wire = _FlatBuckets(self._params, bucket_bytes)
        self.version = 0

    def receive(self) -> int:
        """Blocks until the learner's broadcast arrives; returns the version received."""
        header = torch.zeros(2, dtype=torch.int64)
        try:
            dist.broadcast(header, src=0)
            version, n_buckets = int(header[0]), int(header[1])
            if n_buckets != len(self._wire.buffers):
                raise WeightSyncError(
                    f"learner sent {n_buckets} weight buckets, this generator expects {len(self._wire.buffers)}: "
                    "the two sides were built from different model specs"
                )
            for buf in self._wire.buffers:
                dist.broadcast(buf, src=0)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight broadcast from the learner failed: {exc}") from exc
        with torch.no_grad():
            self._wire.unpack(self._params)
        self.version = version
        return version
