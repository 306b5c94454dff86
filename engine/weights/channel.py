"""Learner -> generator weights on one host: shared-memory slots guarded by file locks.

A model's channel is a directory (under /dev/shm) of *slot* files, each holding one
whole copy of the weights after a 64-byte header (an int64 version stamp), plus a
``head`` symlink whose target reads ``"<version>:<slot>"``. The leader of the model's
learner group writes; any number of generators read, and they may come and go at any
time: nobody needs to know who else is there.

Why nobody reads half-written weights and nobody waits:
- A reader holds a shared ``flock`` on the slot whose weights it uses (on a CPU its
  parameters *are* views of that slot: zero copy). The writer packs only into a slot on
  which it gets an exclusive lock without blocking, and never into the slot ``head``
  names; when every slot is held, it creates another. The writer never waits for readers.
- The writer stamps -1 first and the version last, then re-points ``head`` (a symlink is
  replaced atomically). A reader locks the slot ``head`` names, then trusts only the
  stamp it reads under its lock: a slot the writer reused meanwhile holds a newer,
  complete version, and a slot whose writer died mid-pack says -1 and is skipped.
- The kernel drops a dead process's locks, so a generator that dies holds nothing.

Weights on a GPU are staged through the slots (device -> host on publish, host -> device
on load). Across hosts there is no shared memory: every node has its own channels, and
``relay`` carries each version to them over ZeroMQ.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

import torch

HEADER = 64  # bytes before the weights in a slot file: the version stamp, then padding (keeps floats aligned)
MAX_RETRIES = 1000  # head re-reads per load: each retry means the writer published meanwhile
_STAMP = struct.Struct("<q")


class WeightSyncError(RuntimeError):
    """Weights could not be published or loaded; the message says why."""


def sync_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters in a stable order, tied weights counted once; only the trained ones when part of the model
    is frozen (LoRA's adapters: every process holds the same frozen base, the warm start)."""
    seen: set[int] = set()
    out = []
    frozen = any(not p.requires_grad for p in model.parameters())
    for p in model.parameters():
        if id(p) not in seen and (p.requires_grad or not frozen):
            seen.add(id(p))
            out.append(p)
    return out


def one_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """The one dtype every weight path carries (a model with several cannot be packed flat)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise WeightSyncError(f"the weight channel carries one dtype, the model has {sorted(map(str, dtypes))}")
    return params[0].dtype


class _Slots:
    """The slot files of one channel, as seen by one process: open files and their mappings."""

    def __init__(self, directory: Path, params: list[torch.Tensor]):
        self.dir, self.params, self.dtype = directory, params, one_dtype(params)
        self.numel = sum(p.numel() for p in params)
        self.nbytes = self.numel * params[0].element_size()
        self.files: dict[int, int] = {}  # slot -> fd
        self.data: dict[int, torch.Tensor] = {}  # slot -> flat weights mapped from its file

    def path(self, slot: int) -> Path:
        return self.dir / f"slot-{slot}"

    def existing(self) -> list[int]:
        return sorted(int(p.name[5:]) for p in self.dir.glob("slot-*"))

    def open(self, slot: int, create: bool = False) -> int:
        if slot not in self.files:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            fd = os.open(self.path(slot), flags, 0o600)
            size = HEADER + self.nbytes
            if create:
                os.ftruncate(fd, size)
            elif (found := os.fstat(fd).st_size) != size:
                os.close(fd)
                raise WeightSyncError(f"{self.path(slot)} holds {found} bytes where this model needs {size}: "
                                      "learner and generator were built from different model specs")
            self.files[slot] = fd
        return self.files[slot]

    def weights(self, slot: int) -> torch.Tensor:
        if slot not in self.data:
            mapped = torch.from_file(str(self.path(slot)), shared=True, size=HEADER + self.nbytes, dtype=torch.uint8)
            self.data[slot] = mapped[HEADER:].view(self.dtype)
        return self.data[slot]

    def views(self, slot: int) -> list[torch.Tensor]:
        """Each parameter's place in the slot, shaped like it."""
        flat, out, offset = self.weights(slot), [], 0
        for p in self.params:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def stamp(self, slot: int) -> int:
        return _STAMP.unpack(os.pread(self.files[slot], _STAMP.size, 0))[0]

    def set_stamp(self, slot: int, version: int) -> None:
        os.pwrite(self.files[slot], _STAMP.pack(version), 0)

    def head(self) -> tuple[int, int]:
        """(version, slot) the head names; (0, -1) before the first publish."""
        try:
            version, slot = os.readlink(self.dir / "head").split(":")
        except FileNotFoundError:
            return 0, -1
        return int(version), int(slot)

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)  # drops this process's locks
        self.files.clear()
        self.data.clear()


class WeightWriter:
    """The learner leader's end: ``publish(version)`` packs the parameters into a free slot."""

    def __init__(self, directory: Path, model: torch.nn.Module):
        directory.mkdir(parents=True, exist_ok=True)
        self.slots = _Slots(directory, sync_params(model))
        self.nbytes = self.slots.nbytes

    def publish(self, version: int) -> None:
        self._publish(version, self._pack)

    def take_lead(self, version: int) -> None:
        """A new leader has nothing to announce: the channel names the newest version, whoever wrote it."""

    def _pack(self, slot: int) -> None:
        with torch.no_grad():
            for view, p in zip(self.slots.views(slot), self.slots.params):
                view.copy_(p.detach())  # device -> host for weights on a GPU

    def _publish(self, version: int, fill) -> None:
        s = self.slots
        slot = self._lock_free_slot()
        try:
            s.set_stamp(slot, -1)  # a crash from here on leaves a slot readers skip
            fill(slot)
            s.set_stamp(slot, version)
            tmp = s.dir / f".head-{os.getpid()}"
            tmp.unlink(missing_ok=True)
            os.symlink(f"{version}:{slot}", tmp)
            os.replace(tmp, s.dir / "head")
        finally:
            fcntl.flock(s.files[slot], fcntl.LOCK_UN)

    def _lock_free_slot(self) -> int:
        s = self.slots
        _, current = s.head()
        for slot in s.existing():
            if slot == current:
                continue
            fd = s.open(slot)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot
            except BlockingIOError:
                continue  # a generator reads it
        slot = max(s.existing(), default=-1) + 1
        fcntl.flock(s.open(slot, create=True), fcntl.LOCK_EX)
        return slot

    def close(self) -> None:
        self.slots.close()


class RawWriter(WeightWriter):
    """A channel's writer that has no model, only its packed bytes (``engine.weights.relay``: a node's copy
    of weights a learner on another machine packed the same way)."""

    def __init__(self, directory: Path, dtype: torch.dtype, numel: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.slots = _Slots(directory, [torch.empty(numel, dtype=dtype, device="meta")])
        self.nbytes = self.slots.nbytes

    def publish_bytes(self, version: int, data) -> None:
        """Publish ``data`` (a buffer of exactly ``nbytes``) as ``version``."""
        if len(memoryview(data).cast("B")) != self.nbytes:
            raise WeightSyncError(f"{self.slots.dir}: {len(memoryview(data).cast('B'))} bytes arrived for a "
                                  f"channel of {self.nbytes}")
        flat = torch.frombuffer(data, dtype=torch.uint8)
        self._publish(version, lambda slot: self.slots.weights(slot).view(torch.uint8).copy_(flat))


class WeightReader:
    """A generator's end: ``load()`` brings the model to the newest published version.

    On a CPU the parameters become views of the slot (the shared lock stays held until
    the next load switches slots); on a GPU they are copied and the lock released at once.
    """

    def __init__(self, directory: Path, model: torch.nn.Module):
        params = sync_params(model)
        self.slots = _Slots(directory, params)
        self.zero_copy = all(p.device.type == "cpu" for p in params)
        self.version = 0
        self._held: int | None = None  # the slot this process's parameters are views of

    def newest(self) -> int:
        return self.slots.head()[0] if self.slots.dir.is_dir() else 0

    def load(self) -> int:
        """Switch to the version the head names if it is not the one held; returns the version held.

        Versions only grow, except when a model's learner is restarted from a checkpoint
        (``engine.failures``): its head then names an older version, which is loaded too."""
        s = self.slots
        for _ in range(MAX_RETRIES):
            version, slot = s.head() if s.dir.is_dir() else (0, -1)
            if version == self.version or slot < 0:
                return self.version
            fd = s.open(slot)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a writer that is packing this slot
            stamp = s.stamp(slot)
            if stamp != version:  # the writer reused it since we read the head: read the head again
                self._unlock(slot)
                continue
            self._take(slot)
            self.version = stamp
            return self.version
        raise WeightSyncError(f"{s.dir}: the head names slot {slot} for version {version}, but the slot never holds "
                              "it (a writer died after re-pointing the head?)")

    def _take(self, slot: int) -> None:
        with torch.no_grad():
            if self.zero_copy:
                for p, view in zip(self.slots.params, self.slots.views(slot)):
                    p.data = view
                old, self._held = self._held, slot
                if old is not None and old != slot:
                    self._unlock(old)
            else:
                for p, view in zip(self.slots.params, self.slots.views(slot)):
                    p.copy_(view)  # host -> device
                self._unlock(slot)

    def _unlock(self, slot: int) -> None:
        if slot != self._held:
            fcntl.flock(self.slots.files[slot], fcntl.LOCK_UN)

    def close(self, detach: bool = False) -> None:
        """Leave the channel; ``detach``: the parameters get private copies of the weights they view first."""
        if detach and self.zero_copy and self._held is not None:
            with torch.no_grad():
                for p in self.slots.params:
                    p.data = p.data.clone()
        self.slots.close()
        self._held = None
