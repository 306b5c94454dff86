"""The pool plane: coordinator <-> pool workers, addressed messages (ZeroMQ ROUTER/DEALER).

The SEE broker is publish/subscribe by topic; a pool needs messages addressed to one
worker (its role, its next prompt batch, its learner group). They travel here, as
msgspec Structs (msgpack, never pickle). The controller's decisions are still the
exchange's ``Assign`` messages: an ``Order`` carries one, and the coordinator also
publishes it on the broker for monitors.

Invariants: the coordinator's ROUTER is bound before any worker starts; a worker's
DEALER identity is its worker id, so the coordinator can address it; messages to a
worker that has gone are dropped by ZeroMQ (ROUTER drops unroutable messages).
"""

from __future__ import annotations

from typing import Union

import msgspec
import zmq
import zmq.asyncio

from exchange.protocol import Assign, PromptBatch


class _Msg(msgspec.Struct, tag=True, array_like=True):
    pass


class GroupSpec(msgspec.Struct, array_like=True, frozen=True):
    """One formation of a model's learner group: ranks in ``members`` order; rank 0 holds the state."""

    model: str
    epoch: int  # increases with every re-formation of this model's group
    endpoint: str  # torch.distributed init_method (tcp://127.0.0.1:port)
    members: list[str]


# worker -> coordinator
class Hello(_Msg, tag="hello"):
    worker_id: str
    pid: int


class WantWork(_Msg, tag="want"):
    """A generator of ``model`` is ready for its next prompt batch."""

    worker_id: str
    model: str


class HandBack(_Msg, tag="back"):
    """A batch the worker will not generate (it is leaving the role): give it to someone else."""

    worker_id: str
    batch: PromptBatch


class BatchDone(_Msg, tag="bdone"):
    worker_id: str
    model: str
    batch_id: int
    prompt_ids: list[int]  # the unit's prompts (a batch is split into work units)
    experiences: int
    weight_version: int
    params_digest: str = ""  # sha256 of the weights used, on a role's first batch (checks the hand-over)


class StepDone(_Msg, tag="sdone"):
    """A learner group finished an optimizer step on these prompts."""

    model: str
    step: int
    epoch: int
    world: int
    prompt_ids: list[int]
    peer_misses: int
    solo: bool


class GroupFormed(_Msg, tag="formed"):
    """A rank joined a group and holds the state rank 0 sent; ``digest`` lets anyone check bit-for-bit."""

    worker_id: str
    model: str
    epoch: int
    rank: int
    step: int
    digest: str


class LearnerFinal(_Msg, tag="final"):
    model: str
    step: int
    queued_prompt_ids: list[int]  # complete own groups never trained (the run ended first)
    consumed_experience_ids: int


# coordinator -> worker
class Order(_Msg, tag="order"):
    """Take ``assign.role`` for ``assign.model`` at the next step boundary (learners: join ``group``)."""

    assign: Assign
    t0: float  # wall-clock start of the RL phase (the cost model's clock)
    group: GroupSpec | None = None


class Regroup(_Msg, tag="regroup"):
    """The learner group of ``group.model`` re-forms as ``group`` at its next step boundary."""

    group: GroupSpec


class Work(_Msg, tag="work"):
    batch: PromptBatch


class Halt(_Msg, tag="halt"):
    """The run is over: finish the current batch or step, report, exit."""

    reason: str


ToCoordinator = Union[Hello, WantWork, HandBack, BatchDone, StepDone, GroupFormed, LearnerFinal]
ToWorker = Union[Order, Regroup, Work, Halt]


class CoordinatorPlane:
    """ROUTER side: ``recv() -> (worker_id, message)``, ``send(worker_id, message)``."""

    def __init__(self, endpoint: str):
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToCoordinator)

    async def recv(self) -> tuple[str, ToCoordinator]:
        identity, payload = await self._sock.recv_multipart()
        return identity.decode(), self._dec.decode(payload)

    async def send(self, worker_id: str, msg: ToWorker) -> None:
        await self._sock.send_multipart([worker_id.encode(), self._enc.encode(msg)])

    def close(self) -> None:
        self._sock.close(linger=0)


class WorkerPlane:
    """DEALER side, identity = worker id."""

    def __init__(self, endpoint: str, worker_id: str):
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.connect(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToWorker)

    async def recv(self) -> ToWorker:
        return self._dec.decode(await self._sock.recv())

    async def send(self, msg: ToCoordinator) -> None:
        await self._sock.send(self._enc.encode(msg))

    def close(self) -> None:
        self._sock.close(linger=2000)
