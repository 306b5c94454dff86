"""Weight sync from a learner to its generators over torch.distributed.

One process group per model: the learner is rank 0, its generators ranks 1..n
(gloo on CPU, NCCL when the tensors live on a GPU). A sync is a broadcast of a
header ``[version, n_buckets, slot]`` followed by the data plane:

- bucketed broadcast (any host, GPU or CPU): the parameters packed into flat
  buckets of at most ``bucket_bytes``, each broadcast through torch.distributed;
- shared memory (every rank on this host, CPU weights): the learner packs into one
  of two ``/dev/shm`` slots, generators copy straight out of it, and a barrier on
  the group releases the slot. The bytes cross the process boundary once instead
  of through loopback TCP; torch.distributed still orders and times every sync.

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
import os
import threading

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
    """Flat buffers mirroring a list of same-dtype parameters, as views of one storage.

    ``storage`` is allocated here, or mapped from a shared-memory file (``shm_path``)
    so that another process on the same host can read the same bytes.
    """

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int, shm_path: str | None = None):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"weight sync expects one dtype for all parameters, got {sorted(map(str, dtypes))}")
        self.layout = _bucket_layout(params, bucket_bytes)
        sizes = [sum(params[i].numel() for i in idx) for idx in self.layout]
        total, dtype = sum(sizes), params[0].dtype
        if shm_path is None:
            self.storage = torch.empty(total, dtype=dtype, device=params[0].device)
        else:
            self.storage = torch.from_file(shm_path, shared=True, size=total, dtype=dtype)
        self.buffers = list(torch.split(self.storage, sizes))
        self.nbytes = total * self.storage.element_size()

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


def shm_paths(group_endpoint: str) -> list[str]:
    """The two shared-memory slots of a weight group (double buffer), named after its endpoint."""
    key = "".join(c if c.isalnum() else "-" for c in group_endpoint.split("://")[-1])
    return [f"/dev/shm/mutual-rl-weights-{key}-{slot}" for slot in (0, 1)]


def data_plane(group_endpoint: str, model: torch.nn.Module) -> list[str] | None:
    """Shared-memory slots when every rank is on this host and the weights are on the CPU, else None."""
    host = group_endpoint.split("://")[-1].rsplit(":", 1)[0]
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if on_cpu and host in ("127.0.0.1", "localhost") and os.path.isdir("/dev/shm"):
        return shm_paths(group_endpoint)
    return None


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
    """Learner side (rank 0): snapshot on publish, send in a background thread.

    ``shm_slots``: two shared-memory paths (``shm_paths``) for the same-host data plane;
    None sends the buckets themselves through torch.distributed.
    """

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shm_slots: list[str] | None = None):
        self._params = _sync_params(model)
        self._shm = shm_slots
        slots = shm_slots or [None, None]
        self._slots = [_FlatBuckets(self._params, bucket_bytes, path) for path in slots]
        self._staging, self._wire = self._slots
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
                    # Swap, don't copy: publish() packs into the other slot while this one is read.
                    self._staging, self._wire = self._wire, self._staging
                slot = self._slots.index(self._wire)
                header = torch.tensor([version, len(self._wire.buffers), slot], dtype=torch.int64)
                dist.broadcast(header, src=0)
                if self._shm is None:
                    for buf in self._wire.buffers:
                        dist.broadcast(buf, src=0)
                else:
                    dist.barrier()  # every generator has copied the slot out: it may be reused
                self._sent_version = version
                self.broadcasts += 1
        except BaseException as exc:  # surfaced on the next publish()
            self.error = exc

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        for path in self._shm or []:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class WeightReceiver:
    """Generator side: join the next sync and load it into the model (between batches only)."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shm_slots: list[str] | None = None):
        self._params = _sync_params(model)
        self._bucket_bytes = bucket_bytes
        self._shm = shm_slots
        self._slots: list[_FlatBuckets] | None = None  # mapped at the first sync: the learner creates them
        self._wire = _FlatBuckets(self._params, bucket_bytes) if shm_slots is None else None
        self._release = None  # the pending slot-release barrier of the last shared-memory sync
        self.version = 0

    def receive(self) -> int:
        """Blocks until the learner's sync arrives; returns the version received."""
        header = torch.zeros(3, dtype=torch.int64)
        try:
            if self._release is not None:
                self._release.wait()
                self._release = None
            dist.broadcast(header, src=0)
            version, n_buckets, slot = (int(x) for x in header)
            source = self._source(slot)
            if n_buckets != len(source.buffers):
                raise WeightSyncError(
                    f"learner sent {n_buckets} weight buckets, this generator expects {len(source.buffers)}: "
                    "the two sides were built from different model specs"
                )
            if self._shm is None:
                for buf in source.buffers:
                    dist.broadcast(buf, src=0)
            with torch.no_grad():
                source.unpack(self._params)
            if self._shm is not None:
                # Release the slot without waiting for the learner's side of the barrier: the
                # generator goes back to work at once; the next receive() completes it first.
                self._release = dist.barrier(async_op=True)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight sync from the learner failed: {exc}") from exc
        self.version = version
        return version

    def _source(self, slot: int) -> _FlatBuckets:
        if self._shm is None:
            return self._wire
        if self._slots is None:
            self._slots = [_FlatBuckets(self._params, self._bucket_bytes, path) for path in self._shm]
        return self._slots[slot]
