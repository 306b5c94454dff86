"""The engine's own messages, coordinator <-> workers, addressed to one worker (ZeroMQ ROUTER/DEALER).

The SEE broker (``exchange``) carries experience and Stats by topic, to anyone. What only
the engine needs travels here: a worker's role, its next work unit, its learner group,
the run's end. Same rules as the wire spec: msgspec Structs, tagged, never pickle.

Invariants: the coordinator's ROUTER is bound before any worker starts; a worker's DEALER
identity is its worker id; a message to a worker that has gone is dropped by ZeroMQ
(ROUTER drops unroutable messages), never queued forever.
"""

from __future__ import annotations

from typing import Union

import msgspec
import zmq
import zmq.asyncio

from exchange.protocol import Assign
from tasks.base import Problem


class _Msg(msgspec.Struct, tag=True, array_like=True):
    pass


class GroupSpec(msgspec.Struct, array_like=True, frozen=True):
    """One formation of a model's learner group: ranks in ``members`` order; rank 0 leads."""

    model: str
    epoch: int  # grows with every re-formation of this model's group
    endpoint: str  # torch.distributed init_method (tcp://host:port)
    members: list[str]
    restore: str = ""  # a checkpoint every rank starts from (a sharded formation broke: its state is lost)


class WorkUnit(msgspec.Struct, array_like=True, frozen=True):
    """Prompts of one learner step for one model's generators: G samples each."""

    model: str
    step: int  # the learner step (batch) these prompts belong to
    group_size: int
    problems: list[Problem]
    min_weight_version: int = 0  # generate with at least this weight version (sync mode: = step)

    @property
    def prompt_ids(self) -> list[int]:
        return [p.prompt_id for p in self.problems]


class StepReport(msgspec.Struct, array_like=True):
    """What a learner step did, for the coordinator's display and bookkeeping (metrics.jsonl has it all)."""

    reward_mean: float
    staleness_mean: float
    step_s: float  # the optimizer step's busy time (not its wait for data)
    own_total: int  # own samples trained on so far
    peer_total: int  # peer samples received so far
    accuracy: float | None = None  # live held-out accuracy (eval.live_problems), when evaluated at this step
    peer_used: int = 0  # peer samples the objective has read so far (of peer_total received)


# worker -> coordinator
class Hello(_Msg, tag="hello"):
    worker_id: str
    pid: int


class WantWork(_Msg, tag="want"):
    """A generator of ``model`` is ready for its next unit."""

    worker_id: str
    model: str


class HandBack(_Msg, tag="back"):
    """A unit the worker will not generate (it is leaving the role): give it to someone else."""

    worker_id: str
    unit: WorkUnit


class UnitDone(_Msg, tag="udone"):
    worker_id: str
    model: str
    prompt_ids: list[int]
    experiences: int
    weight_version: int
    busy_s: float  # generating (weights loaded, sampled, verified), without waiting for work
    params_digest: str = ""  # sha256 of the weights used, on a role's first unit (checks the hand-over)
    verify_timeouts: int = 0  # completions the task's verifier ran out of time on (judged wrong)


class StepDone(_Msg, tag="sdone"):
    """A learner group finished an optimizer step on these prompts."""

    model: str
    step: int
    epoch: int
    world: int
    prompt_ids: list[int]
    peer_misses: int
    solo: bool
    report: StepReport


class GroupFormed(_Msg, tag="formed"):
    """A rank joined a group and holds the state rank 0 sent; ``digest`` lets anyone check bit for bit."""

    worker_id: str
    model: str
    epoch: int
    rank: int
    step: int
    digest: str


class GroupBroken(_Msg, tag="broken"):
    """A collective of the group failed (a rank died): this rank waits for the next formation."""

    worker_id: str
    model: str
    epoch: int
    reason: str


class LearnerFinal(_Msg, tag="final"):
    """A model's leader stopped: its checkpoint, final held-out accuracy and what it never trained."""

    model: str
    step: int
    queued_prompt_ids: list[int]  # complete own groups never trained (the run ended first)
    checkpoint: str
    accuracy: float | None
    accuracy_stderr: float | None
    eval_n: int
    own_total: int
    peer_total: int
    peer_used: int
    stopped_early: bool


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
    unit: WorkUnit


class PeersGone(_Msg, tag="gone"):
    """Every model that sends no experience now, and why (the whole set: a silent model may come back).

    A learner does not wait for these and trains without them."""

    gone: dict[str, str]


class Halt(_Msg, tag="halt"):
    """The run is over: finish the current unit or step, report, exit."""

    reason: str


class BrokerBack(_Msg, tag="broker"):
    """The broker died and a new one runs on the same endpoints and log: a leader re-subscribes and replays
    the log for what was logged but never reached it."""

    restarts: int


ToCoordinator = Union[Hello, WantWork, HandBack, UnitDone, StepDone, GroupFormed, GroupBroken, LearnerFinal]
ToWorker = Union[Order, Regroup, Work, PeersGone, Halt, BrokerBack]


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
