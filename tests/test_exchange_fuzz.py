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
from exchange.subscriber import Subscriber

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
# A message cut short must lack a field it cannot do without (the trailing ones have defaults).
_REQUIRED = sum(f.required for f in msgspec.structs.fields(Experience))


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
    st.just(("item", msgspec.msgpack.encode(_TEMPLATE[:_REQUIRED]))),  # tag + all but one required
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
        deadline = loop.time() + 30  # the broker's Stats keep coming: without a deadline a miscount waits forever
        while len(got) < len(goods) or not (last and last.accepted_total == state["goods"] and last.rejected_total >= state["bad"]):
            assert loop.time() < deadline, f"got {len(got)}/{len(goods)} goods; last broker stats {last}"
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


# --- a replayed corpus of 10,000 hostile frames, and a sender that is cut off ---

def _corpus(n: int, seed: int = 7) -> list[bytes]:
    """``n`` bad frames, deterministic: random bytes, truncations and bit flips of good frames, bad items."""
    import random

    rng, enc = random.Random(seed), Encoder()
    whole = Encoder.frame([enc.encode(_good(0))])
    items = [_wrong_type(i) for i in range(len(_TEMPLATE))] + [_with(reward=math.nan), _with(schema=SCHEMA_VERSION + 1)]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(bytes([rng.choice([0xC1, 0x00, 0xFF])]) + rng.randbytes(rng.randrange(0, 64)))
        elif kind == 1:
            out.append(whole[: rng.randrange(1, len(whole))])
        elif kind == 2:
            flipped = bytearray(whole)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            out.append(bytes(flipped) if bytes(flipped) != whole else b"\xc1")
        else:
            out.append(Encoder.frame([rng.choice(items)]))
    return out


def _broker(tmp, **settings_) -> tuple:
    cfg = BrokerConfig(frontend=f"ipc://{tmp}/front", backend=f"ipc://{tmp}/back", log_dir=str(tmp / "log"),
                       max_frame_bytes=CAP, stats_interval_s=0.05, **settings_)
    return cfg, spawn_broker(cfg)


async def _last_stats(sub: Subscriber, done) -> Stats:
    while True:
        msg = await asyncio.wait_for(sub.recv(), 60)
        if isinstance(msg, Stats) and msg.role == "broker" and done(msg):
            return msg


def test_ten_thousand_hostile_frames_are_all_counted_and_the_broker_still_serves(tmp_path, loop):
    cfg, proc = _broker(tmp_path, max_rejects_per_sender=10**9)
    ctx = zmq.Context()
    push = ctx.socket(zmq.DEALER)
    push.connect(cfg.frontend)
    sub = Subscriber(cfg.backend, ["exp.", "stats"], name="victim")
    loop.run_until_complete(sub.ready())
    corpus = _corpus(10_000)
    for frame in corpus:
        push.send(frame)
    push.send(Encoder.frame([Encoder().encode(_good(99))]))  # the sentinel, after every hostile frame
    stats = loop.run_until_complete(_last_stats(
        sub, lambda s: s.rejected_total + s.accepted_total + s.duplicate_total > len(corpus)))
    # a bit flip inside a token array leaves a well-formed message: the broker accepts it (the learner's
    # ingest checks vocabulary and run id), or counts it as a repeat when its experience id is logged
    # already; random bytes, truncations and wrong types never pass
    flips_that_decode = stats.accepted_total + stats.duplicate_total - 1
    print(f"hostile frames: {len(corpus)} sent, {stats.rejected_total} rejected, {flips_that_decode} bit flips "
          f"decoded as well-formed messages ({stats.accepted_total - 1} accepted, {stats.duplicate_total} repeated "
          "ids refused)")
    assert stats.rejected_total + flips_that_decode == len(corpus) and stats.rejected_total >= len(corpus) * 3 // 4
    assert proc.is_alive()
    push.send(Encoder.frame([Encoder().encode(Control(SCHEMA_VERSION, "stop"))]))
    proc.join(30)
    sub.close()
    push.close(linger=0)
    ctx.term()
    assert proc.exitcode == 0


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_sender_past_the_bad_message_limit_is_cut_off_and_named(tmp_path, loop, capfd):
    cfg, proc = _broker(tmp_path, max_rejects_per_sender=50)
    ctx = zmq.Context()
    hostile, honest = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.ROUTING_ID, b"mallory")
    for s in (hostile, honest):
        s.connect(cfg.frontend)
    sub = Subscriber(cfg.backend, ["exp.", "stats"], name="victim")
    loop.run_until_complete(sub.ready())
    enc = Encoder()
    for _ in range(60):
        hostile.send(b"\xc1junk")
    hostile.send(Encoder.frame([enc.encode(_good(1))]))  # a good frame after the cut-off: dropped unread
    honest.send(Encoder.frame([enc.encode(_good(2))]))

    async def check() -> Stats:
        got = []
        while not got:
            msg = await asyncio.wait_for(sub.recv(), 30)
            if isinstance(msg, Experience):
                got.append(msg.experience_id)
        assert got == [_good(2).experience_id]
        return await _last_stats(sub, lambda s: s.rejected_total >= 61)

    stats = loop.run_until_complete(check())
    name = "peer-" + b"mallory".hex()
    assert stats.rejected_total == 61 and stats.accepted_total == 1
    assert stats.cut_off == [name] and stats.rejected_by_sender == {name: 61}
    hostile.send(Encoder.frame([enc.encode(Control(SCHEMA_VERSION, "stop"))]))  # cut off: not even a stop
    honest.send(Encoder.frame([enc.encode(Control(SCHEMA_VERSION, "stop"))]))
    proc.join(30)
    assert proc.exitcode == 0
    assert f"sender {name} cut off after 50 bad messages" in capfd.readouterr().err
    sub.close()
    for s in (hostile, honest):
        s.close(linger=0)
    ctx.term()
