"""Weight sync from a learner to its generators over torch.distributed.

One process group per model: the learner is rank 0, its generators ranks 1..n
(gloo on CPU, NCCL when the tensors live on a GPU). A sync is a broadcast of a
header ``[version, n_buckets, slot]`` followed by the data plane:

- bucketed broadcast (any host, GPU or CPU): the parameters packed into flat
  buckets of at most ``bucket_bytes``, each broadcast through torch.distributed;
- shared memory (every rank on this host, CPU weights): the learner packs into one
  of three ``/dev/shm`` slots and the generators' parameters become views of it (no
  copy on their side); a barrier on the group tells the learner which slot is free.
  The bytes are copied once instead of three times through loopback TCP;
  torch.distributed still orders and times every sync.

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

    def views(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's place in these buffers, shaped like it (zero-copy)."""
        out: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for idx, buf in zip(self.layout, self.buffers):
            offset = 0
            for i in idx:
                n = params[i].numel()
                out[i] = buf[offset : offset + n].view_as(params[i])
                offset += n
        return out

    def unpack(self, params: list[torch.Tensor]) -> None:
        for idx, buf in zip(self.layout, self.buffers):
            offset = 0
            for i in idx:
                n = params[i].numel()
                params[i].data.copy_(buf[offset : offset + n].view_as(params[i]))
                offset += n


def shm_paths(group_endpoint: str) -> list[str]:
    """The three shared-memory slots of a weight group, named after its endpoint.

    Three, because at any moment one slot is read by the generators, one was just sent
    (generators switch to it at their next batch boundary) and one is free for the
    learner to pack into, so neither side ever waits for the other."""
    key = "".join(c if c.isalnum() else "-" for c in group_endpoint.split("://")[-1])
    return [f"/dev/shm/mutual-rl-weights-{key}-{slot}" for slot in (0, 1, 2)]


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

    ``shm_slots``: the three shared-memory paths of ``shm_paths`` for the same-host data
    plane; None sends the buckets themselves through torch.distributed.
    """

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shm_slots: list[str] | None = None):
        self._params = _sync_params(model)
        self._shm = shm_slots
        self._slots = [_FlatBuckets(self._params, bucket_bytes, path) for path in (shm_slots or [None, None])]
        self._pack_slot = 0  # where publish() writes
        self._read_slot: int | None = None  # shm: the slot the generators read from now
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
        return self._slots[0].nbytes

    def publish(self, version: int) -> None:
        """Stage the current parameters as ``version``; returns at once."""
        if self.error is not None:
            raise WeightSyncError(f"weight broadcast failed earlier: {self.error}") from self.error
        with self._cond:
            self._slots[self._pack_slot].pack(self._params)
            self._staged_version = version
            self._cond.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or self._staged_version > self._sent_version)
                    if self._closed:
                        return
                    version, wire = self._staged_version, self._pack_slot
                    # Pack the next version elsewhere: not into the slot on the wire, nor the one being read.
                    busy = {wire, self._read_slot}
                    self._pack_slot = next(i for i in range(len(self._slots)) if i not in busy)
                header = torch.tensor([version, len(self._slots[wire].buffers), wire], dtype=torch.int64)
                dist.broadcast(header, src=0)
                if self._shm is None:
                    for buf in self._slots[wire].buffers:
                        dist.broadcast(buf, src=0)
                else:
                    dist.barrier()  # every generator now reads `wire` and has left the previous slot
                    self._read_slot = wire
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
    """Generator side: join the next sync and load it into the model (between batches only).

    Shared-memory plane: the model's parameters become views of the slot just sent
    (zero-copy); the learner never writes a slot a generator may still read.
    """

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shm_slots: list[str] | None = None):
        self._params = _sync_params(model)
        self._bucket_bytes = bucket_bytes
        self._shm = shm_slots
        self._views: list[list[torch.Tensor]] | None = None  # per slot; mapped at the first sync
        self._wire = _FlatBuckets(self._params, bucket_bytes) if shm_slots is None else None
        self._release = None  # the pending barrier of the last shared-memory sync
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
            if self._shm is None:
                self._receive_buckets(n_buckets)
            else:
                self._switch_to(slot, n_buckets)
                # Tell the learner we left the previous slot, without waiting for its side.
                self._release = dist.barrier(async_op=True)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight sync from the learner failed: {exc}") from exc
        self.version = version
        return version

    def _check(self, n_buckets: int, expected: int) -> None:
        if n_buckets != expected:
            raise WeightSyncError(
                f"learner sent {n_buckets} weight buckets, this generator expects {expected}: "
                "the two sides were built from different model specs"
            )

    def _receive_buckets(self, n_buckets: int) -> None:
        self._check(n_buckets, len(self._wire.buffers))
        for buf in self._wire.buffers:
            dist.broadcast(buf, src=0)
        with torch.no_grad():
            self._wire.unpack(self._params)

    def _switch_to(self, slot: int, n_buckets: int) -> None:
        if self._views is None:  # the learner created the slots before its first header
            mapped = [_FlatBuckets(self._params, self._bucket_bytes, path) for path in self._shm]
            self._check(n_buckets, len(mapped[0].buffers))
            self._views = [m.views(self._params) for m in mapped]
        for param, view in zip(self._params, self._views[slot]):
            param.data = view
