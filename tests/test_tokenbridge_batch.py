"""Bridge.batch: what one call per completion gives, in order, errors returned in place and counted alike."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbridge import (
    BUILTIN_NAMES,
    Bridge,
    BridgeError,
    EmptyCompletionError,
    InvalidMaskError,
    InvalidTokenIdError,
    NonFiniteLogprobError,
    SpecialTokenError,
    UndecodableTextError,
    load_tokenizer,
)

GPT2_EOS, QWEN_IM_START = 50256, 151644


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    return {name: load_tokenizer(name, cache) for name in BUILTIN_NAMES}


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def same(a, b) -> bool:
    """Two outcomes are the same: equal errors, or equal arrays, groups and residual."""
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a) is type(b) and str(a) == str(b)
    fields = ("dst_ids", "dst_mask", "dst_group", "src_group")
    return (
        a.text == b.text and a.residual == b.residual and a.eos == b.eos
        and all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in fields)
        and (a.dst_logprobs is None) == (b.dst_logprobs is None)
        and (a.dst_logprobs is None or a.dst_logprobs.tobytes() == b.dst_logprobs.tobytes())
        and all(getattr(a.groups, f).tobytes() == getattr(b.groups, f).tobytes() for f in ("src", "dst", "chars"))
    )


def calls(bridge: Bridge, ids, logprobs, masks) -> list:
    out = []
    for i, lp, m in zip(ids, logprobs, masks):
        try:
            out.append(bridge(i, lp, m))
        except BridgeError as exc:
            out.append(exc)
    return out


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize(("src", "dst"), [("gpt2", "qwen2"), ("qwen2", "mistral"), ("mistral", "mistral")])
def test_batch_equals_one_call_each_with_bad_completions_in_place(toks, src, dst):
    tok = toks[src]
    eos = tok.eos_token_id
    ids = [
        ids_of(tok, "The answer is 42.") + [eos],
        [],  # empty
        ids_of(tok, "x") + [len(tok) + 5],  # outside the vocabulary
        ids_of(tok, "café e\u0301 \u212b"),  # NFC changes it: Qwen2 takes the normalised path
        ids_of(tok, "ok 🫠")[:-1],  # cut inside a character (undecodable for byte-level sources)
        ids_of(tok, "nan here"),
        ids_of(tok, "The answer is 42.") + [eos],  # a repeat: a cache hit, as for calls
        [eos],  # only EOS
        ids_of(tok, "mask") + [eos],
    ]
    logprobs = [np.full(len(i), -0.5) for i in ids]
    logprobs[5] = np.full(len(ids[5]), np.nan)
    masks = [None] * len(ids)
    masks[8] = [1] * (len(ids[8]) - 1) + [2]
    batch_bridge, call_bridge = Bridge(toks[src], toks[dst]), Bridge(toks[src], toks[dst])
    got = batch_bridge.batch(ids, logprobs, masks)
    want = calls(call_bridge, ids, logprobs, masks)
    assert len(got) == len(ids) and all(same(a, b) for a, b in zip(got, want))
    assert batch_bridge.stats == call_bridge.stats
    assert isinstance(got[1], EmptyCompletionError) and isinstance(got[2], InvalidTokenIdError)
    assert isinstance(got[5], NonFiniteLogprobError) and isinstance(got[8], InvalidMaskError)
    assert batch_bridge.stats.cache_hits == 1


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_array_ids_outside_the_vocabulary_cost_only_their_completion(toks, dtype):
    """Arrays skip the per-completion range check (the batch's spelling does it): a bad id must still give
    its completion the call's error, naming position and value, and leave the others as calls give them."""
    tok = toks["qwen2"]
    texts = ["The answer is 42.", "x", "caf\u00e9 \u00fc \u4f60\u597d", "y", "last one"]
    ids = [np.array(ids_of(tok, text), dtype=dtype) for text in texts]
    ids[1] = np.append(ids[1], len(tok) + 5).astype(dtype)  # past the end
    ids[3] = np.insert(ids[3], 0, -3).astype(dtype)  # negative, first
    logprobs = [np.full(len(i), -0.25, dtype=np.float32) for i in ids]
    got = Bridge(tok, toks["gpt2"]).batch(ids, logprobs)
    want = calls(Bridge(tok, toks["gpt2"]), ids, logprobs, [None] * len(ids))
    assert all(same(a, b) for a, b in zip(got, want))
    assert isinstance(got[1], InvalidTokenIdError) and f"= {len(tok) + 5} " in str(got[1])
    assert isinstance(got[3], InvalidTokenIdError) and "src_ids[0] = -3 " in str(got[3])
    assert [r.text for r in (got[0], got[2], got[4])] == [texts[0], texts[2], texts[4]]


def test_mixed_float_log_probs_and_an_overflowing_group_equal_calls_bit_for_bit(toks):
    """float32 and float64 log-probs in one batch, and a completion whose group sum overflows in the middle."""
    tok, rng = toks["gpt2"], np.random.default_rng(3)
    texts = ["The answer is 42.", "caf\u00e9 \u4f60\u597d 17 + 25", "overflow here", "  spaces  and 3.14159", "end"]
    ids = [np.array(ids_of(tok, text), dtype=np.int64) for text in texts]
    logprobs = [-rng.random(len(i)) * 5 for i in ids]
    logprobs[1], logprobs[3] = logprobs[1].astype(np.float32), logprobs[3].astype(np.float32)
    logprobs[2] = np.full(len(ids[2]), -1e308)  # finite one by one; some group sums overflow
    got = Bridge(tok, toks["mistral"]).batch(ids, logprobs)
    want = calls(Bridge(tok, toks["mistral"]), ids, logprobs, [None] * len(ids))
    assert all(same(a, b) for a, b in zip(got, want))
    assert isinstance(got[2], NonFiniteLogprobError)
    assert all(r.dst_mask.all() and r.dst_logprobs.dtype == np.float64 for r in (got[0], got[1], got[3], got[4]))


def test_special_token_inside_one_completion_costs_only_that_one(toks):
    bridge = Bridge(toks["qwen2"], toks["gpt2"])
    out = bridge.batch([[9707, QWEN_IM_START, 1879], [9707, 1879]])
    assert isinstance(out[0], SpecialTokenError) and out[1].text == "Hello world"
    assert bridge.stats.rejected == 1 and bridge.stats.bridged == 1


def test_undecodable_is_counted(toks):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    out = bridge.batch([ids_of(toks["gpt2"], "ok 🫠")[:-1], ids_of(toks["gpt2"], "ok")])
    assert isinstance(out[0], UndecodableTextError) and bridge.stats.undecodable == 1


def test_empty_batch_and_argument_lengths(toks):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    assert bridge.batch([]) == []
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 completions"):
        bridge.batch([[15496], [995]], logprobs=[[-0.1]])
    with pytest.raises(ValueError, match="masks has 3 entries for 2 completions"):
        bridge.batch([[15496], [995]], masks=[None, None, None])


def test_batch_results_are_independent_arrays(toks):
    """Completions of one batch share memory underneath; each result must still read as its own."""
    bridge = Bridge(toks["gpt2"], toks["mistral"], cache_size=0)
    a, b = bridge.batch([ids_of(toks["gpt2"], "first one") + [GPT2_EOS], ids_of(toks["gpt2"], "second")])
    assert a.dst_group[0] == 0 and b.dst_group[0] == 0 and b.groups.src[0] == 0 and b.groups.chars[0] == 0
    assert a.dst_ids[-1] == 2 and b.text == "second"
    with pytest.raises(ValueError):
        b.dst_ids[0] = 0


def test_nfc_and_non_nfc_texts_in_one_batch(toks):
    """Qwen2's NFC-only normalizer is skipped for a batch of NFC texts; one non-NFC text sends the batch
    through the full encoder. Either way: the destination's own ids, and what calls give."""
    texts = ["caf\u00e9 \u00c5ngstr\u00f6m \ud55c\uad6d\uc5b4", "cafe\u0301 \u212b", "plain ascii"]
    for batch in (texts[::2], texts):
        bridge = Bridge(toks["gpt2"], toks["qwen2"])
        ids = [ids_of(toks["gpt2"], text) for text in batch]
        out = bridge.batch(ids)
        for text, result, one in zip(batch, out, calls(Bridge(toks["gpt2"], toks["qwen2"]), ids, [None] * 3, [None] * 3)):
            assert result.dst_ids.tolist() == ids_of(toks["qwen2"], text) and same(result, one)
