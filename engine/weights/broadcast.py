"""Learner -> generator weights device to device: a torch.distributed pair group per leader and generator.

``pool.weights = "broadcast"``: NCCL between GPUs (no host copy on either side), gloo on CPUs
(how it is tested). The run's *board* is a torch.distributed TCPStore the coordinator hosts;
every process of the run reaches it at ``WorkerPlan.weights_board``.

    leader: publish(v) -> snapshot (the weights, packed in buckets) ; board["weights/<m>"] = "v <tag>"
    generator: load()  -> reads the board; if v is not what it holds: takes a ticket from the leader's
                          ``<tag>``, and receives the snapshot over the pair group it shares with that leader

Why it holds while MWRA moves workers:
- Nobody needs to know the membership. A leader serves whoever asks, one ticket at a time, from
  a thread; a generator asks whoever the board names. A new leader (a move, a re-formation, a
  restart from a checkpoint) publishes as it takes the lead, so the board never names a leader
  that has gone for longer than a failure takes to be seen.
- A pair group is formed on a generator's first ask of a leader (``<tag>`` names one leader's
  one writer) and kept for later versions; a failed send drops it on both sides, and the next
  ask forms a fresh one under a fresh prefix.
- The snapshot is the packed copy the leader made at ``publish``: the next optimizer step never
  changes bytes in flight. A generator receives every bucket before it changes a weight, so a
  leader that dies mid-send leaves it on its old version, whole (it asks again at its next unit).
- Every collective and every pair formation is bounded by ``timeouts.weights_s``.

The same-host shared-memory channel (``channel``) stays the default, and the CPU path.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from engine.weights.channel import one_dtype, sync_params
from engine.weights.collective import WeightSyncError, pack, receive, send_packed

POLL_S = 0.01  # a leader's server looks for a new ask this often (a store read; no c10d wait, which logs time-outs)
NOBODY = "-"  # the board's leader tag once the writer it named has closed
LOST_TICKET_S = 5.0  # an ask whose ticket was taken but never written (its generator died in between) is skipped
_tags = itertools.count()
_stores: dict[str, dist.TCPStore] = {}


def open_board(host: str) -> tuple[dist.TCPStore, str]:
    """The coordinator's end: a TCPStore on a free port of ``host``; returns it and the ``host:port`` to hand out."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    return store, f"{host}:{store.port}"


def _store(address: str, timeout_s: float) -> dist.TCPStore:
    """One client connection per process to the board at ``host:port``."""
    if address not in _stores:
        host, port = address.rsplit(":", 1)
        _stores[address] = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=timeout_s))
    return _stores[address]


def _pair(store: dist.TCPStore, prefix: str, rank: int, device: torch.device, timeout_s: float):
    """A standalone two-rank group (leader rank 0, generator rank 1), not torch.distributed's default group: a
    learner's own group keeps that one."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, store)
    try:
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:
            group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        # NCCL connects on the first collective, so a peer that died before it would only show in the first
        # sync; one all-reduce now makes formation fail here, on NCCL as on gloo (engine.train.group.NCCL_FAILURE_ENV:
        # the wait raises at the time-out)
        hello = torch.ones(1, device=device)
        group.allreduce([hello]).wait()
        if int(hello.item()) != 2:
            raise RuntimeError(f"the hello all-reduce gave {hello.item()}, not 2")
        return group
    except Exception as exc:  # the other side died or never came, past the time-out
        raise WeightSyncError(f"weight sync: the pair group {prefix} did not form: {exc}") from exc


class _End:
    """What both ends hold: the board, the weights in ``sync_params`` order (one dtype, one device), who we are."""

    def __init__(self, board: str, model: str, module: torch.nn.Module, timeout_s: float, me: str):
        self.model, self.timeout_s, self.me = model, timeout_s, f"{me}-{os.getpid()}"
        self.store = _store(board, timeout_s)
        params = sync_params(module)
        self.dtype, self.device = one_dtype(params), params[0].device
        self.named = [(str(i), p) for i, p in enumerate(params)]


class BroadcastWriter(_End):
    """A leader's end (the ``WeightWriter`` API): ``publish(version)`` snapshots, a thread serves the asks."""

    def __init__(self, board: str, model: str, module: torch.nn.Module, timeout_s: float, me: str):
        super().__init__(board, model, module, timeout_s, me)
        self.nbytes = sum(t.numel() for _, t in self.named) * self.named[0][1].element_size()
        self.tag = f"{self.me}-{next(_tags)}"  # this writer: a pair group is never shared by two of them
        self.snapshot: tuple[int, list[torch.Tensor]] | None = None
        self.pairs: dict[str, object] = {}  # generator -> its pair group with this writer
        self.ticket = 1  # the next ask to answer (asks are numbered by the board, from 1)
        self.served = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, version: int) -> None:
        flats = pack(self.named, self.dtype, self.device)
        if self.device.type == "cuda":  # the copies above, on this thread's stream; not the whole device, whose
            torch.cuda.current_stream(self.device).synchronize()  # NCCL streams a dead peer could hold forever
        self.snapshot = (version, flats)  # one reference swap: a send in progress keeps the one it took
        self.store.set(f"weights/{self.model}", f"{version} {self.tag}")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name=f"weights-{self.model}", daemon=True)
            self._thread.start()

    take_lead = publish  # a new leader names itself on the board at once (the channel needs no such step)

    def _serve(self) -> None:
        """Answer asks in ticket order until closed, or until the board names another leader (this rank follows
        now: a ``publish`` when it leads again serves again, under the same tag)."""
        missing_since = time.time()
        while not self._stop.is_set():
            ticket = self.ticket
            key = f"ask/{self.tag}/{ticket}"
            if not self.store.check([key]):
                if time.time() - missing_since > LOST_TICKET_S:
                    if self.store.get(f"weights/{self.model}").decode().split()[1] != self.tag:
                        return
                    if self.store.add(f"asks/{self.tag}", 0) > ticket:
                        self.ticket += 1
                    missing_since = time.time()
                time.sleep(POLL_S)
                continue
            who, fresh = self.store.get(key).decode().split()
            self.store.delete_key(key)
            self.store.set(f"ack/{self.tag}/{ticket}", "")  # the asker waits for this before it forms a group
            self._answer(who, fresh == "1", f"pair/{self.tag}/{ticket}/")
            self.ticket, missing_since = ticket + 1, time.time()

    def _answer(self, who: str, fresh: bool, prefix: str) -> None:
        try:
            if fresh:
                self.pairs[who] = _pair(self.store, prefix, 0, self.device, self.timeout_s)
            if who in self.pairs:  # else it holds a group this writer dropped: its receive fails, it asks afresh
                version, flats = self.snapshot
                send_packed(flats, version, 0, self.pairs[who])
                self.served += 1
        except WeightSyncError as exc:
            self.pairs.pop(who, None)
            print(f"[{self.me}] {self.model} weights to {who}: {exc}"[:300], file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop serving; the board stops naming this writer (askers give up at once, not at the time-out)."""
        self._stop.set()
        if self.snapshot is not None:
            mine = f"{self.snapshot[0]} {self.tag}"
            self.store.compare_set(f"weights/{self.model}", mine, f"{self.snapshot[0]} {NOBODY}")
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
        self.pairs.clear()


class BroadcastReader(_End):
    """A generator's end (the ``WeightReader`` API): ``load()`` brings the model to the version the board names."""

    _pairs: dict[str, object] = {}  # leader tag -> pair group, for the whole process (roles come and go)
    version = 0

    def newest(self) -> tuple[int, str]:
        """(version, leader tag) the board names; (0, "") before the first publish."""
        key = f"weights/{self.model}"
        if not self.store.check([key]):
            return 0, ""
        version, tag = self.store.get(key).decode().split()
        return int(version), tag

    def load(self) -> int:
        """Switch to the version the board names if it is not the one held; returns the version held (the old
        one, whole, when the leader did not answer: the next load asks again)."""
        version, tag = self.newest()
        if tag in ("", NOBODY) or version == self.version:
            return self.version
        for old in [t for t in self._pairs if t != tag]:  # a leader that is no longer named will not be asked
            del self._pairs[old]
        ticket = self.store.add(f"asks/{tag}", 1)
        fresh = tag not in self._pairs
        self.store.set(f"ask/{tag}/{ticket}", f"{self.me} {int(fresh)}")
        try:
            self._acknowledged(tag, ticket)
            if fresh:
                self._pairs[tag] = _pair(self.store, f"pair/{tag}/{ticket}/", 1, self.device, self.timeout_s)
            self.version = receive(self.named, 0, self.dtype, self.device, self._pairs[tag])
        except WeightSyncError as exc:
            self._pairs.pop(tag, None)
            print(f"[{self.me}] {self.model} weights from {tag}: {exc}"[:300], file=sys.stderr, flush=True)
        return self.version

    def _acknowledged(self, tag: str, ticket: int) -> None:
        """Wait for the leader to take the ask; give up as soon as the board names another leader (this one died
        or moved: its successor publishes as it takes the lead), or at the time-out."""
        deadline, ack = time.time() + self.timeout_s, f"ack/{tag}/{ticket}"
        while not self.store.check([ack]):
            if self.newest()[1] != tag or time.time() > deadline:
                raise WeightSyncError(f"weight sync: the leader {tag} did not take the ask (it is no longer named, "
                                      f"or {self.timeout_s:g} s passed)")
            time.sleep(POLL_S)
        self.store.delete_key(ack)

    def close(self, detach: bool = False) -> None:
        """Nothing to give back: the parameters own their memory (``detach`` is the channel reader's concern)."""
