"""SEE codec: round trips of every message type, and one typed error per kind of bad input."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange import codec
from exchange.codec import Decoder, Encoder
from exchange.protocol import (
    SCHEMA_VERSION,
    Assign,
    Control,
    Experience,
    Stats,
    Subscribe,
    WeightsReady,
    pack_floats,
    pack_ids,
)
from exchange.samples import make_experience

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
text = st.text(max_size=40)


@st.composite
def experiences(draw) -> Experience:
    n = draw(st.integers(0, 64))
    group = draw(st.integers(1, 32))
    return Experience(
        SCHEMA_VERSION, draw(text), draw(text), draw(text), draw(text), draw(st.integers(0, 2**40)),
        draw(st.integers(0, group - 1)), group, draw(st.integers(0, 2**31)),
        pack_ids(draw(st.lists(st.integers(0, 2**31 - 1), max_size=32))),
        pack_ids(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))),
        pack_floats(draw(st.lists(st.floats(-1e6, 0, width=32), min_size=n, max_size=n))),
        draw(st.text(max_size=200)), draw(finite), draw(st.booleans()), draw(st.sampled_from(["stop", "length"])),
        draw(finite), draw(finite),
    )


messages = st.one_of(
    experiences(),
    st.builds(Stats, st.just(SCHEMA_VERSION), text, st.sampled_from(["generator", "learner", "broker", "idle"]), text,
              finite, finite, samples_per_s=finite, queue_depth=st.integers(0, 10**6),
              topic_rates=st.dictionaries(text, finite, max_size=3)),
    st.builds(Assign, st.just(SCHEMA_VERSION), st.integers(0, 10**6), text,
              st.sampled_from(["generator", "learner", "idle"]), text, reason=text),
    st.builds(WeightsReady, st.just(SCHEMA_VERSION), text, st.integers(0, 10**6), st.integers(0, 10**6),
              st.integers(0, 2**40), finite),
    st.builds(Control, st.just(SCHEMA_VERSION), st.just("stop"), text, text),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6))
def test_every_message_type_survives_a_frame_round_trip(msgs):
    enc, dec = Encoder(), Decoder()
    frame = dec.decode_frame(Encoder.frame([enc.encode(m) for m in msgs]))
    assert frame.errors == []
    assert frame.messages == msgs
    assert [bytes(r) for r in frame.raws] == [enc.encode(m) for m in msgs]


def test_arrays_keep_dtype_and_values():
    exp = make_experience(7, completion_tokens=5)
    got = Decoder().decode(Encoder().encode(exp))
    assert got.completion_array.dtype == np.int32 and got.logprob_array.dtype == np.float32
    np.testing.assert_array_equal(got.completion_array, exp.completion_array)
    np.testing.assert_array_equal(got.logprob_array, exp.logprob_array)


def _raw(msg) -> bytes:
    """Encode without the sender-side checks, as a buggy or hostile peer would."""
    return msgspec.msgpack.encode(msg)


def _fields(msg) -> list:
    """The generic msgpack array of a message: [tag, schema, field, ...], bytes kept as bytes."""
    return msgspec.msgpack.decode(_raw(msg))


def _error(data: bytes, decoder: Decoder | None = None) -> codec.DecodeError:
    frame = (decoder or Decoder()).decode_frame(data)
    assert frame.messages == [] and len(frame.errors) == 1
    return frame.errors[0]


def test_truncated_frame_is_reported_as_truncated():
    data = Encoder.frame([_raw(make_experience(1))])
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        err = _error(data[:cut])
        assert isinstance(err, codec.Truncated) and err.field == "frame"


def test_oversized_frame_is_rejected_unread():
    data = Encoder.frame([_raw(make_experience(1))])
    err = _error(data, Decoder(max_frame_bytes=len(data) - 1))
    assert isinstance(err, codec.TooLarge) and str(len(data)) in str(err)
    with pytest.raises(codec.TooLarge):
        Encoder(max_frame_bytes=100).encode(make_experience(1))


def test_wrong_type_names_the_field():
    fields = _fields(make_experience(1))
    fields[fields.index("stop")] = "exploded"  # finish_reason outside its Literal
    err = _error(Encoder.frame([msgspec.msgpack.encode(fields)]))
    assert isinstance(err, codec.SchemaMismatch) and err.field == "Experience.finish_reason"
    fields = _fields(make_experience(1))
    fields[6] = "not an int"  # prompt_id
    assert _error(Encoder.frame([msgspec.msgpack.encode(fields)])).field == "Experience.prompt_id"


def test_newer_schema_is_refused_with_a_clear_error():
    newer = make_experience(1)
    newer.schema = SCHEMA_VERSION + 1
    err = _error(Encoder.frame([_raw(newer)]))
    assert isinstance(err, codec.SchemaTooNew) and "newer" in str(err)
    # a newer writer that also added a field: the reader must still say "newer", not "wrong shape"
    fields = _fields(newer) + ["a field from the future"]
    fields[0] = "stats"
    assert isinstance(_error(Encoder.frame([msgspec.msgpack.encode(fields)])), codec.SchemaTooNew)


@pytest.mark.parametrize("field", ["reward", "created_at"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_scalars_are_rejected(field, value):
    exp = make_experience(1)
    setattr(exp, field, value)
    err = _error(Encoder.frame([_raw(exp)]))
    assert isinstance(err, codec.NonFinite) and err.field == field
    with pytest.raises(codec.NonFinite):
        Encoder().encode(exp)


def test_non_finite_logprob_names_its_index():
    exp = make_experience(1, completion_tokens=8)
    lp = exp.logprob_array.copy()
    lp[5] = np.nan
    exp.behaviour_logprobs = pack_floats(lp)
    err = _error(Encoder.frame([_raw(exp)]))
    assert isinstance(err, codec.NonFinite) and err.field == "behaviour_logprobs[5]"


def test_huge_but_finite_logprobs_are_accepted():
    exp = make_experience(1, completion_tokens=4)
    exp.behaviour_logprobs = pack_floats([-3e38, -3e38, -1.0, 0.0])  # x.x overflows float32; still finite
    assert Decoder().decode(_raw(exp)) == exp


def test_ids_and_logprobs_must_align():
    exp = make_experience(1, completion_tokens=8)
    exp.behaviour_logprobs = exp.behaviour_logprobs[:-4]
    err = _error(Encoder.frame([_raw(exp)]))
    assert isinstance(err, codec.BadArray) and "7 entries" in str(err) and "8" in str(err)
    exp = make_experience(1)
    exp.prompt_ids = exp.prompt_ids + b"\x00"
    assert _error(Encoder.frame([_raw(exp)])).field == "prompt_ids"


def test_sample_index_outside_group_is_rejected():
    exp = make_experience(1)
    exp.sample_index = exp.group_size
    assert isinstance(_error(Encoder.frame([_raw(exp)])), codec.InvalidValue)


def test_not_a_frame_and_empty_frame_are_rejected():
    assert isinstance(_error(msgspec.msgpack.encode(42)), codec.Malformed)
    assert isinstance(_error(b"\xc1"), codec.Malformed)  # 0xc1 is never valid msgpack
    assert isinstance(_error(Encoder.frame([])), codec.Malformed)


def test_unknown_tag_and_link_message_on_a_data_socket_are_rejected():
    err = _error(Encoder.frame([msgspec.msgpack.encode(["nope", 1, 2])]))
    assert isinstance(err, codec.SchemaMismatch) and "nope" in str(err)
    sub = Subscribe(SCHEMA_VERSION, "x", ["exp."], True, 1)
    err = _error(Encoder.frame([_raw(sub)]))
    assert isinstance(err, codec.SchemaMismatch) and "Subscribe" in str(err)


def test_good_messages_around_a_bad_one_survive():
    good1, good2, bad = make_experience(1), make_experience(2), make_experience(3)
    bad.reward = math.nan
    frame = Decoder().decode_frame(Encoder.frame([_raw(good1), _raw(bad), _raw(good2)]))
    assert frame.messages == [good1, good2] and len(frame.errors) == 1
