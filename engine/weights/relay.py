"""Learner -> generator weights across machines: every node keeps its own channels, a hub on node 0 feeds them.

    leader (any node) --PUSH--> hub (node 0, in the coordinator) <--ask/answer-- relay (one per node)
                                                                                   |
                                                              the node's channels (``channel``), read by
                                                              its generators exactly as on one machine

In a cluster a leader does not write its own node's channel: every version goes through the
hub, so each node's channels have one writer (its relay) and see the versions in one order,
whichever node leads a model and however often it moves. The hub keeps only the newest
version of each model and answers a relay's ``Want`` (the hub sequence it holds of each
model) with one newer version, or as soon as there is one: a slow node never holds a
learner back and never gets a version older than one it has.

The bytes are the channel's own layout (``sync_params`` order, one dtype), sent zero-copy.
This is the CPU-and-ethernet path; NCCL between GPUs is ``collective``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import torch
import zmq
import zmq.asyncio

from engine.weights.channel import RawWriter, WeightWriter, one_dtype, sync_params
from exchange.link import recv_multipart
from exchange.security import ClientKeys, apply_client


class Packed(msgspec.Struct, array_like=True, frozen=True):
    """One version of one model's weights: ``numel`` values of ``dtype`` follow in the next frame."""

    model: str
    version: int
    dtype: str  # "float32", "bfloat16", ...
    numel: int
    seq: int = 0  # the hub's order of arrival (set by the hub)


class Want(msgspec.Struct, array_like=True, frozen=True):
    """A relay asks for any model newer than the hub sequence it holds of it."""

    known: dict[str, int]


def _bind(sock: zmq.Socket, host: str, curve) -> str:
    if curve is not None:
        curve.apply(sock)
    sock.bind(f"tcp://{'[' + host + ']' if ':' in host else host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class WeightsHub:
    """Node 0's end: ``inbound`` takes leaders' versions, ``outbound`` answers relays. Run ``serve()`` as a task."""

    def __init__(self, host: str, curve=None):
        ctx = zmq.asyncio.Context.instance()
        self._in, self._out = ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
        for sock in (self._in, self._out):
            sock.setsockopt(zmq.LINGER, 0)
        self.inbound, self.outbound = _bind(self._in, host, curve), _bind(self._out, host, curve)
        self.latest: dict[str, tuple[Packed, zmq.Frame]] = {}
        self.waiting: dict[bytes, dict[str, int]] = {}  # relay identity -> what it holds
        self.seq = 0
        self.received = 0

    async def serve(self) -> None:
        await asyncio.gather(self._take(), self._asked())

    async def _take(self) -> None:
        dec = msgspec.msgpack.Decoder(Packed)
        while True:
            header, data = await recv_multipart(self._in, copy=False)
            self.seq += 1
            packed = msgspec.structs.replace(dec.decode(header.bytes), seq=self.seq)
            self.latest[packed.model] = (packed, data)
            self.received += 1
            for identity in list(self.waiting):
                await self._answer(identity)

    async def _asked(self) -> None:
        dec = msgspec.msgpack.Decoder(Want)
        while True:
            identity, want = await recv_multipart(self._out)
            self.waiting[identity] = dec.decode(want).known
            await self._answer(identity)

    async def _answer(self, identity: bytes) -> None:
        known = self.waiting[identity]
        newer = [(p.seq, p, data) for p, data in self.latest.values() if p.seq > known.get(p.model, 0)]
        if newer:
            _, packed, data = min(newer, key=lambda t: t[0])
            del self.waiting[identity]
            await self._out.send_multipart([identity, msgspec.msgpack.encode(packed), data], copy=False)

    def close(self) -> None:
        self._in.close(linger=0)
        self._out.close(linger=0)


class Relay:
    """A node's end: asks the hub for every newer version and publishes it into the node's channel of its model."""

    def __init__(self, endpoint: str, root: Path, curve: ClientKeys | None = None):
        self.root = root
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_client(self._sock, curve)
        self._sock.connect(endpoint)
        self.writers: dict[str, RawWriter] = {}
        self.relayed = 0

    async def serve(self) -> None:
        known: dict[str, int] = {}
        dec = msgspec.msgpack.Decoder(Packed)
        while True:
            await self._sock.send(msgspec.msgpack.encode(Want(known)))
            header, data = await recv_multipart(self._sock, copy=False)
            packed = dec.decode(header.bytes)
            writer = self.writers.get(packed.model)
            if writer is None:
                writer = RawWriter(self.root / packed.model, getattr(torch, packed.dtype), packed.numel)
                self.writers[packed.model] = writer
            await asyncio.to_thread(writer.publish_bytes, packed.version, data.buffer)
            known[packed.model] = packed.seq
            self.relayed += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        for writer in self.writers.values():
            writer.close()


class RelayWriter:
    """A leader's end in a cluster: ``publish(version)`` sends its weights to the hub (the ``WeightWriter`` API)."""

    def __init__(self, endpoint: str, model: str, module: torch.nn.Module, curve: ClientKeys | None = None):
        self.model, self.params = model, sync_params(module)
        self.dtype = one_dtype(self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.nbytes = self.numel * self.params[0].element_size()
        self._sock = zmq.Context.instance().socket(zmq.PUSH)  # used from one thread at a time (to_thread)
        self._sock.setsockopt(zmq.SNDHWM, 2)  # a hub that does not take them: publish waits, never queues a model a step
        self._sock.setsockopt(zmq.LINGER, 2000)
        apply_client(self._sock, curve)
        self._sock.connect(endpoint)

    take_lead = WeightWriter.take_lead

    def publish(self, version: int) -> None:
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params]).cpu()
        header = Packed(self.model, version, str(self.dtype).removeprefix("torch."), self.numel)
        self._sock.send_multipart([msgspec.msgpack.encode(header), flat.view(torch.uint8).numpy()], copy=False)

    def close(self) -> None:
        self._sock.close(linger=2000)
