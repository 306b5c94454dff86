"""Hostile frames against a live broker (its own process) and a live Subscriber.

Every example throws malformed, truncated, oversized, wrong-type, wrong-version and
non-finite frames, some of them mixed into frames with good messages, then checks that
nobody crashed, every bad part was counted exactly once, and every good message still
arrived, in order, exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import math

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.broker import BrokerConfig, spawn_broker
from exchange.codec import Encoder
from exchange.protocol import SCHEMA_VERSION, Control, Experience, Stats, Subscribed
from exchange.samples import make_experience
from exchange.transport import Subscriber

CAP = 64 * 1024  # size cap for both the broker and the subscriber under test
ARRAY_MARKERS = {*range(0x90, 0xA0), 0xDC, 0xDD}
FUZZ = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
pytestmark = pytest.mark.timeout(300)


def _good(seq: int) -> Experience:
    return make_experience(seq, "m0", completion_tokens=8, text_chars=20)


def _fields(msg) -> list:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


_TEMPLATE = _fields(_good(0))
_TYPES = [None, *(f.type for f in msgspec.structs.fields(Experience))]  # index 0 is the tag


def _wrong_type(index: int) -> bytes:
    fields = list(_TEMPLATE)
    fields[index] = 12345 if _TYPES[index] is str or index == 0 else "wrong"
    return msgspec.msgpack.encode(fields)


def _with(**changes) -> bytes:
    exp = _good(0)
    for key, value in changes.items():
        setattr(exp, key, value)
    return msgspec.msgpack.encode(exp)  # no sender-side checks: a buggy peer


# Each bad part: (kind, encoded item or whole frame). "frame" parts are sent alone; "item"
# parts may be sent alone (wrapped in a frame) or between two good messages. Each counts 1.
bad_parts = st.one_of(
    st.binary(max_size=200).filter(lambda b: not b or b[0] not in ARRAY_MARKERS).map(lambda b: ("frame", b)),
    st.floats(0, 0.999).map(lambda f: ("truncate", f)),
    st.just(("frame", Encoder.frame([msgspec.msgpack.encode(make_experience(1, text_chars=CAP))]))),
    st.integers(0, len(_TEMPLATE) - 1).map(lambda i: ("item", _wrong_type(i))),
    st.just(("item", msgspec.msgpack.encode(_TEMPLATE[:-1]))),
    st.integers(SCHEMA_VERSION + 1, 2**31 - 1).map(lambda v: ("item", _with(schema=v))),
    st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: ("item", _with(reward=v))),
    st.just(("item", _with(behaviour_logprobs=b"\x00\x00\xc0\x7f" * 8))),  # float32 NaNs
    st.just(("item", _with(behaviour_logprobs=b"\x00" * 12))),  # 3 log-probs for 8 tokens
    st.just(("frame", Encoder.frame([b"\xc1"]))),  # an item that is not msgpack breaks its whole frame
)
examples = st.lists(st.tuples(bad_parts, st.booleans()), min_size=1, max_size=6)


class Feed:
    """Turns drawn bad parts into frames interleaved with numbered good messages."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.enc = Encoder()

    def frames(self, drawn) -> tuple[list[bytes], list[str]]:
        frames, goods = [], []

        def good() -> bytes:
            exp = _good(next(self.seq))
            goods.append(exp.experience_id)
            return self.enc.encode(exp)

        for (kind, value), mixed in drawn:
            if kind == "truncate":
                whole = Encoder.frame([good()])
                goods.pop()
                frames.append(whole[: int(value * len(whole))])
            elif kind == "frame":
                frames.append(value)
            elif mixed:
                frames.append(Encoder.frame([good(), value, good()]))
            else:
                frames.append(Encoder.frame([value]))
        frames.append(Encoder.frame([good()]))  # the sentinel: it arrives after everything above
        return frames, goods


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


# --- the broker ---

@pytest.fixture(scope="module")
def live_broker(tmp_path_factory, loop):
    tmp = tmp_path_factory.mktemp("fuzz-broker")
    cfg = BrokerConfig(frontend=f"ipc://{tmp}/front", backend=f"ipc://{tmp}/back", log_dir=str(tmp / "log"),
                       max_frame_bytes=CAP, stats_interval_s=0.02)
    proc = spawn_broker(cfg)
    ctx = zmq.Context()
    push = ctx.socket(zmq.DEALER)  # a hostile publisher speaks raw bytes
    push.connect(cfg.frontend)
    rogue = ctx.socket(zmq.DEALER)  # a hostile subscriber, too
    rogue.connect(cfg.backend)
    sub = Subscriber(cfg.backend, ["exp.", "stats"], name="victim")
    loop.run_until_complete(sub.ready())
    state = {"goods": 0, "bad": 0, "feed": Feed()}
    yield proc, push, rogue, sub, state
    push.send(Encoder.frame([Encoder().encode(Control(SCHEMA_VERSION, "stop"))]))
    proc.join(30)
    sub.close()
    push.close(linger=0)
    rogue.close(linger=0)
    ctx.term()
    assert proc.exitcode == 0


@FUZZ
@given(drawn=examples, rogue_frames=st.lists(st.binary(max_size=50).filter(lambda b: not b or b[0] not in ARRAY_MARKERS), max_size=2))
def test_broker_counts_every_bad_frame_and_delivers_every_good_one(live_broker, loop, drawn, rogue_frames):
    proc, push, rogue, sub, state = live_broker
    frames, goods = state["feed"].frames(drawn)
    for frame in frames:
        push.send(frame)
    for junk in rogue_frames:
        rogue.send(junk)
    state["goods"] += len(goods)
    state["bad"] += len(drawn) + len(rogue_frames)

    async def check() -> None:
        got, last = [], None
        while len(got) < len(goods) or not (last and last.accepted_total == state["goods"] and last.rejected_total >= state["bad"]):
            msg = await asyncio.wait_for(sub.recv(), 30)
            if isinstance(msg, Experience):
                got.append(msg.experience_id)
            elif isinstance(msg, Stats) and msg.role == "broker":
                last = msg
        assert got == goods
        assert last.rejected_total == state["bad"] and last.dropped_total == 0

    loop.run_until_complete(check())
    assert proc.is_alive() and sub.rejected == 0


# --- a subscriber, fed by a hostile "broker" ---

@pytest.fixture(scope="module")
def live_subscriber(tmp_path_factory, loop):
    tmp = tmp_path_factory.mktemp("fuzz-sub")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp}/fake-broker")
    sub = Subscriber(f"ipc://{tmp}/fake-broker", ["exp."], name="victim", max_frame_bytes=CAP)
    assert router.poll(10_000), "the subscriber never said hello"
    identity, hello = router.recv_multipart()
    token = msgspec.msgpack.decode(hello)[0][5]  # [[tag, schema, name, topics, lossless, token]]
    router.send_multipart([identity, Encoder.frame([Encoder().encode(Subscribed(SCHEMA_VERSION, token))])])
    loop.run_until_complete(sub.ready(10))
    yield router, identity, sub, {"bad": 0, "feed": Feed()}
    sub.close()
    router.close(linger=0)
    ctx.term()


@FUZZ
@given(drawn=examples)
def test_subscriber_counts_every_bad_frame_and_delivers_every_good_one(live_subscriber, loop, drawn):
    router, identity, sub, state = live_subscriber
    frames, goods = state["feed"].frames(drawn)
    for frame in frames:
        router.send_multipart([identity, frame])
    state["bad"] += len(drawn)

    async def receive() -> list[str]:
        return [(await asyncio.wait_for(sub.recv(), 30)).experience_id for _ in goods]

    assert loop.run_until_complete(receive()) == goods
    assert sub.rejected == state["bad"]
