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

from exchange.link import recv_multipart
from exchange.protocol import Assign
from exchange.security import ClientKeys, apply_client
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
    trained: list[int] | None = None  # the leader died with its inbox: the prompts trained; rank 0 replays the rest


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
    truncated_frac: float = 0.0  # share of this step's own samples that hit train.max_new_tokens
    eval_truncated: float | None = None  # share of the live evaluation's completions cut, when evaluated
    eval_n: int = 0  # distinct problems behind ``accuracy``: eval.live_problems, or fewer where the task has fewer


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
    reward_errors: int = 0  # completions the verifier raised on, scored 0 (train.reward_errors = "zero")
    reward_error: str = ""  # the first of them, described (roles.generator.reward_error_text)


class RewardFailed(_Msg, tag="rfail"):
    """A generator's verifier raised (train.reward_errors = "stop"): the run stops; nothing of the unit was sent."""

    worker_id: str
    model: str
    text: str  # the exception, where it was raised and on which problem


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
    truncated: float | None = None  # share of the final evaluation's completions cut at its max_new_tokens


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

    reason: str  # END_OF_RUN, or REWARD_FAILED: a leader's final evaluation then calls no reward function that failed


END_OF_RUN, REWARD_FAILED = "end of run", "reward failed"


class BrokerBack(_Msg, tag="broker"):
    """The broker died and a new one runs on the same endpoints and log: a leader re-subscribes and replays
    the log for what was logged but never reached it."""

    restarts: int


# node agent (a launcher on node r > 0 of a cluster, engine.cluster.agent) <-> coordinator
class NodeHello(_Msg, tag="nhello"):
    """A node's launcher is connected: ``address`` is where the node's workers are reached from the others."""

    node: int
    address: str
    pid: int
    weights_root: str  # the node's own weight channels (engine.weights.relay keeps them fresh)
    problem: str = ""  # why the node cannot serve the run (it then exits): the run stops with this line


class NodeBeat(_Msg, tag="beat"):
    """Either side is alive (every ``cluster.HEARTBEAT_S``): a node or a coordinator silent for long is gone."""


class ActorExited(_Msg, tag="aexit"):
    """An actor this node spawned has exited with ``exitcode``."""

    node: int
    name: str
    exitcode: int


class NodeDone(_Msg, tag="ndone"):
    """The node stopped every actor it spawned (after ``NodeStop``); their exit codes."""

    node: int
    exitcodes: dict[str, int]


class Spawn(_Msg, tag="spawn"):
    """Start an actor on this node: ``entry`` over ``payload`` (a worker: its encoded WorkerPlan)."""

    name: str
    entry: str
    payload: bytes
    threads: int


class Signal(_Msg, tag="signal"):
    """Send ``signum`` to one actor of this node (the coordinator's escalation when it will not stop)."""

    name: str
    signum: int


class NodeStop(_Msg, tag="nstop"):
    """The run is over: stop every actor (``grace_s`` to exit on their own), answer ``NodeDone``, exit."""

    grace_s: float


ToCoordinator = Union[Hello, WantWork, HandBack, UnitDone, RewardFailed, StepDone, GroupFormed, GroupBroken, LearnerFinal,
                      NodeHello, NodeBeat, ActorExited, NodeDone]
ToWorker = Union[Order, Regroup, Work, PeersGone, Halt, BrokerBack]
ToNode = Union[Spawn, Signal, NodeBeat, NodeStop]


class CoordinatorPlane:
    """ROUTER side: ``recv() -> (worker_id, message)``, ``send(worker_id, message)``."""

    def __init__(self, endpoint: str, curve=None):
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # a cluster's CurveServer (engine.cluster.node)
            curve.apply(self._sock)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://HOST:* -> the port taken
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToCoordinator)

    async def recv(self) -> tuple[str, ToCoordinator]:
        identity, payload = await recv_multipart(self._sock)
        return identity.decode(), self._dec.decode(payload)

    async def send(self, worker_id: str, msg: ToWorker | ToNode) -> None:
        await self._sock.send_multipart([worker_id.encode(), self._enc.encode(msg)])

    def close(self) -> None:
        self._sock.close(linger=0)


class WorkerPlane:
    """DEALER side, identity = worker id (a node agent: ``node<r>``, reading ``ToNode``)."""

    def __init__(self, endpoint: str, worker_id: str, reads=ToWorker, curve: ClientKeys | None = None):
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        apply_client(self._sock, curve)
        self._sock.connect(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(reads)

    async def recv(self):
        return self._dec.decode((await recv_multipart(self._sock))[0])

    async def send(self, msg: ToCoordinator) -> None:
        await self._sock.send(self._enc.encode(msg))

    def close(self) -> None:
        self._sock.close(linger=2000)
