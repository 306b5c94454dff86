"""SEE wire protocol: every message the system sends, one msgspec Struct each.

This module is the spec. Rules that hold for every message:

- Structs are tagged (``tag`` = short name), array-like on the wire, and the first
  field is ``schema``: a reader refuses a message whose schema is newer than
  ``SCHEMA_VERSION`` with a clear error (see ``exchange.codec``).
- Token ids travel as little-endian int32 bytes, log-probs as little-endian float32
  bytes (``pack_ids`` / ``pack_floats``); a list of Python floats costs ~5x more to
  encode and decode. Alignment rule: ``behaviour_logprobs`` has exactly as many
  entries as ``completion_ids``.
- Topics: experience of model ``m`` travels on topic ``exp.<m>``; see ``topic_for``.
"""

from __future__ import annotations

import time
from typing import Literal, Union

import msgspec
import numpy as np

SCHEMA_VERSION = 1

IDS_DTYPE = np.dtype("<i4")
FLOAT_DTYPE = np.dtype("<f4")


def pack_ids(ids) -> bytes:
    """Token ids (any int sequence or array) -> int32 LE bytes."""
    return np.ascontiguousarray(ids, dtype=IDS_DTYPE).tobytes()


def pack_floats(values) -> bytes:
    """Floats (any sequence or array) -> float32 LE bytes."""
    return np.ascontiguousarray(values, dtype=FLOAT_DTYPE).tobytes()


def unpack_ids(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=IDS_DTYPE)


def unpack_floats(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=FLOAT_DTYPE)


class _Message(msgspec.Struct, tag=True, array_like=True, gc=False, frozen=False):
    """Base of all wire messages (not sent itself)."""


# generator -> broker -> learners (own and peers), monitors, experience log
class Experience(_Message, tag="exp"):
    """One sampled completion for one prompt, with its behaviour trace and reward."""

    schema: int
    run_id: str
    experience_id: str  # unique in a run: "<model>/<prompt_id>/<sample_index>/<generator>"
    model: str  # the generating model's name (also the topic suffix)
    task: str
    prompt_id: int  # global prompt id: the same id means the same prompt for every model
    sample_index: int  # 0 .. group_size-1 within this model's group for the prompt
    group_size: int  # G: how many samples this model draws for the prompt
    weight_version: int  # version of the weights that generated it
    prompt_ids: bytes  # int32 LE, the generator's own tokenizer and template
    completion_ids: bytes  # int32 LE, the generator's own tokenizer
    behaviour_logprobs: bytes  # float32 LE, one per completion token (alignment rule)
    completion_text: str
    reward: float
    verified: bool  # the task's verifier accepted the completion
    finish_reason: Literal["stop", "length"]
    created_at: float  # unix seconds, when the prompt batch reached the generator
    generated_at: float  # unix seconds, when sampling finished
    reward_parts: list[float] = []  # each reward function's reward (NaN: it abstained), with [reward] funcs set

    @property
    def completion_array(self) -> np.ndarray:
        return unpack_ids(self.completion_ids)

    @property
    def prompt_array(self) -> np.ndarray:
        return unpack_ids(self.prompt_ids)

    @property
    def logprob_array(self) -> np.ndarray:
        return unpack_floats(self.behaviour_logprobs)


# any worker -> controller, monitors
class Stats(_Message, tag="stats"):
    """Throughput and queue figures a worker reports once per window."""

    schema: int
    worker_id: str
    role: Literal["generator", "learner", "broker", "idle"]
    model: str
    time: float
    window_s: float
    samples_per_s: float = 0.0  # generator: completions produced
    tokens_per_s: float = 0.0  # generator: completion tokens produced
    consumed_per_s: float = 0.0  # learner: experiences consumed by the optimizer
    queue_depth: int = 0  # learner: experiences waiting; broker: largest subscriber backlog
    idle_frac: float = 0.0  # fraction of the window spent waiting for work
    staleness_mean: float = 0.0
    peer_wait_s: float = 0.0  # learner: time spent waiting for peer results
    weight_version: int = 0
    dropped: int = 0  # messages dropped in the window (counted, never silent)
    rejected: int = 0  # malformed messages rejected in the window
    # broker only (cumulative since start, so a late reader needs no earlier window):
    accepted_total: int = 0  # messages accepted from publishers
    rejected_total: int = 0
    dropped_total: int = 0
    topic_rates: dict[str, float] = {}  # messages/s per topic in the window
    subscriber_backlog: dict[str, int] = {}  # messages waiting per subscriber name (slow ones show here)
    rejected_by_sender: dict[str, int] = {}  # bad messages per publisher connection (the worst ones)
    cut_off: list[str] = []  # publishers past the broker's max_rejects_per_sender: dropped unread
    duplicate_total: int = 0  # experiences whose id the log holds already (a publisher re-sent them): not routed
    subscriber_dropped: dict[str, int] = {}  # messages a lossy subscriber lost, per name, since it subscribed


# coordinator -> monitors (workers get theirs over the engine's own plane)
class Assign(_Message, tag="assign"):
    """A role assignment: ``worker_id`` becomes ``role`` for ``model`` at its next step boundary."""

    schema: int
    epoch: int  # increases with every decision; stale assignments are ignored
    worker_id: str
    role: Literal["generator", "learner", "idle"]
    model: str
    reason: str = ""


# learner -> monitors
class WeightsReady(_Message, tag="weights"):
    """A learner announces that weight version ``version`` of ``model`` can be fetched."""

    schema: int
    model: str
    version: int
    step: int
    nbytes: int
    time: float


# anyone -> the broker (and any reader of ``ctl``)
class Control(_Message, tag="ctl"):
    """Stop the broker (target "*" or its name): the end of a standalone exchange."""

    schema: int
    command: Literal["stop"]
    target: str = "*"  # the broker's name, or "*" for everyone
    reason: str = ""


Message = Union[Experience, Stats, Assign, WeightsReady, Control]

MESSAGE_TYPES: tuple[type, ...] = (Experience, Stats, Assign, WeightsReady, Control)


# --- link messages: between the transport and the broker only, never delivered to application code ---


# subscriber -> broker
class Subscribe(_Message, tag="sub"):
    """Start (or refresh) a subscription; the broker answers ``Subscribed``. Idempotent."""

    schema: int
    name: str  # shown in Stats.subscriber_backlog
    topics: list[str]  # prefixes; "" means everything
    lossless: bool  # True: a full backlog pauses the publishers; False: excess is dropped and counted
    token: int  # echoed in Subscribed, so a subscriber can match the answer to its request
    max_rate: float = 0.0  # lossy only: at most this many experiences/s reach it (a sample); the rest count as dropped


# broker -> subscriber
class Subscribed(_Message, tag="subok"):
    """The subscription is live: every message the broker accepts from now on is routed to it."""

    schema: int
    token: int


# subscriber -> broker
class Unsubscribe(_Message, tag="unsub"):
    """The subscriber is leaving (or answers ``Closing``); the broker frees its backlog."""

    schema: int


# broker -> subscriber
class Closing(_Message, tag="closing"):
    """The broker is stopping and nothing follows; the subscriber answers ``Unsubscribe``, which
    tells the broker every earlier frame arrived (ZeroMQ's linger alone can cut the last ones)."""

    schema: int


# publisher -> broker
class Sync(_Message, tag="sync"):
    """Asks the broker to confirm it has processed every frame this publisher sent before it."""

    schema: int
    token: int


# broker -> publisher
class Synced(_Message, tag="syncok"):
    """Everything the publisher sent before ``Sync(token)`` is logged and routed (or counted as rejected)."""

    schema: int
    token: int
    accepted_total: int  # the broker's cumulative count, for the curious


LinkMessage = Union[Subscribe, Subscribed, Unsubscribe, Closing, Sync, Synced]

LINK_TYPES: tuple[type, ...] = (Subscribe, Subscribed, Unsubscribe, Closing, Sync, Synced)


def topic_for(msg: Message) -> str:
    """The topic a message travels on; subscribers filter by prefix."""
    if isinstance(msg, Experience):
        return f"exp.{msg.model}"
    if isinstance(msg, WeightsReady):
        return f"weights.{msg.model}"
    if isinstance(msg, Stats):
        return "stats"
    if isinstance(msg, Assign):
        return "assign"
    return "ctl"


def now() -> float:
    return time.time()
