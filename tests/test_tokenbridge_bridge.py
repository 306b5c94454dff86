"""THL bridge behaviour on real tokenizers: bad input, EOS and special tokens, undecodable bytes,
normalisation, the identity path, the cache, masks, and the learner sequence."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenbridge import (
    BUILTIN_NAMES,
    Bridge,
    EmptyCompletionError,
    InvalidLogprobError,
    InvalidMaskError,
    InvalidTokenIdError,
    LengthMismatchError,
    NonFiniteLogprobError,
    SpecialTokenError,
    UndecodableTextError,
    UnsupportedTokenizerError,
    build_learner_sequence,
    load_tokenizer,
)

GPT2_EOS, MISTRAL_EOS, QWEN_EOS, QWEN_IM_END, QWEN_IM_START = 50256, 2, 151643, 151645, 151644


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    return {name: load_tokenizer(name, cache) for name in BUILTIN_NAMES}


@pytest.fixture(scope="module")
def g2m(toks):
    return Bridge(toks["gpt2"], toks["mistral"])


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- bad input: each a typed error with a sentence naming the field ------------------------------


@pytest.mark.parametrize(
    ("ids", "logprobs", "mask", "error", "message"),
    [
        ([], None, None, EmptyCompletionError, "src_ids is empty"),
        ([15496, 50257], None, None, InvalidTokenIdError, r"src_ids\[1\] = 50257 is outside the source vocabulary"),
        ([-1, 995], None, None, InvalidTokenIdError, r"src_ids\[0\] = -1 is outside"),
        ([1.5, 2.0], None, None, InvalidTokenIdError, "must be integers"),
        ([[15496, 995]], None, None, InvalidTokenIdError, "1-D"),
        ([15496, 995], [-0.1], None, LengthMismatchError, r"logprobs has shape \(1,\) but src_ids has \(2,\)"),
        ([15496, 995], None, [True], LengthMismatchError, r"mask has shape \(1,\)"),
        ([15496, 995], [-0.1, float("nan")], None, NonFiniteLogprobError, r"logprobs\[1\] is nan"),
        ([15496, 995], [float("-inf"), -0.2], None, NonFiniteLogprobError, r"logprobs\[0\] is -inf"),
        ([15496, 995], ["a", "b"], None, InvalidLogprobError, "logprobs must be a 1-D sequence of numbers"),
    ],
)
def test_bad_input_is_a_typed_error(toks, ids, logprobs, mask, error, message):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    with pytest.raises(error, match=message):
        bridge(ids, logprobs, mask)
    assert bridge.stats.rejected == 1 and bridge.stats.bridged == 0


def test_huge_but_finite_logprobs_are_accepted(g2m):
    out = g2m([15496, 995], [-1e308, -1e308])  # their sum overflows; each value is still finite
    assert np.isfinite(out.dst_logprobs).all()


def test_group_sum_that_overflows_is_rejected(toks):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    # "H" "ell" "o" is one aligned group (Mistral spells it "▁Hello"): finite one by one, -inf together
    with pytest.raises(NonFiniteLogprobError, match=r"logprobs\[0:3\] sum to -inf in aligned group 0"):
        bridge([39, 695, 78], [-1e308, -1e308, -1e308])
    assert bridge.stats.rejected == 1 and bridge.stats.bridged == 0


@pytest.mark.parametrize(
    ("mask", "message"),
    [([True, float("nan")], r"mask\[1\] is nan; a loss mask holds booleans or 0/1"),
     ([1, 2], r"mask\[1\] is 2;"), ([0.5, 1.0], r"mask\[0\] is 0.5;"), ([-1, 0], r"mask\[0\] is -1;"),
     (["yes", "no"], "mask must hold booleans \\(or 0/1\\), got dtype <U3"),
     ([1 + 0j, 0j], "mask must hold booleans \\(or 0/1\\), got dtype complex128")],
)
def test_mask_that_is_not_booleans_is_rejected(toks, mask, message):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    with pytest.raises(InvalidMaskError, match=message):
        bridge([15496, 995], mask=mask)
    assert bridge.stats.rejected == 1


@pytest.mark.parametrize("mask", [[1, 0], [1.0, 0.0], np.array([1, 0], dtype=np.uint8), [True, False]])
def test_mask_of_zeros_and_ones_is_read_as_booleans(g2m, mask):
    assert g2m([15496, 995], mask=mask).dst_mask.tolist() == [True, False]


def test_uint64_id_past_int64_is_reported_as_given(toks):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    with pytest.raises(InvalidTokenIdError, match=r"src_ids\[0\] = 9223372036854775808 is outside"):
        bridge(np.array([2**63, 995], dtype=np.uint64))
    with pytest.raises(InvalidTokenIdError, match=r"src_ids\[1\] = 18446744073709551615 is outside"):
        bridge(np.array([15496, 2**64 - 1], dtype=np.uint64))


# -- EOS and special tokens ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "eos_in", "eos_out"),
    [("gpt2", "mistral", [GPT2_EOS], MISTRAL_EOS), ("qwen2", "gpt2", [QWEN_IM_END], GPT2_EOS),
     ("mistral", "qwen2", [MISTRAL_EOS], QWEN_EOS), ("qwen2", "mistral", [QWEN_IM_END, QWEN_EOS], MISTRAL_EOS)],
)
def test_trailing_eos_maps_to_destination_eos(toks, src, dst, eos_in, eos_out):
    body = ids_of(toks[src], "The answer is 42.")
    logprobs = np.linspace(-1.0, -0.1, len(body) + len(eos_in))
    out = Bridge(toks[src], toks[dst])(body + eos_in, logprobs)
    assert out.eos and out.text == "The answer is 42."
    assert out.dst_ids.tolist() == ids_of(toks[dst], out.text) + [eos_out]
    last = len(out.groups) - 1
    assert out.groups.src[last:].tolist() == [len(body), len(body) + len(eos_in)]
    assert out.groups.chars[-1] == out.groups.chars[-2]  # the EOS group holds no characters
    assert out.dst_logprobs[-1] == pytest.approx(logprobs[len(body):].sum())
    assert out.dst_group[-1] == last


def test_eos_only_completion_is_one_group(toks):
    out = Bridge(toks["gpt2"], toks["qwen2"])([GPT2_EOS], [-0.5])
    assert out.dst_ids.tolist() == [QWEN_EOS] and out.text == "" and out.residual == 0.0
    assert out.dst_logprobs.tolist() == [-0.5]


def test_dst_eos_override(toks):
    out = Bridge(toks["gpt2"], toks["qwen2"], dst_eos_id=QWEN_IM_END)(ids_of(toks["gpt2"], "ok") + [GPT2_EOS])
    assert out.dst_ids[-1] == QWEN_IM_END


@pytest.mark.parametrize(
    ("src", "ids", "message"),
    [("qwen2", [9707, QWEN_IM_START, 1879], r"src_ids\[1\] = 151644 is a special token inside the completion"),
     ("qwen2", [9707, QWEN_EOS, 1879], r"src_ids\[1\] = 151643"),
     ("mistral", [1, 22557], r"src_ids\[0\] = 1 is a special token")],  # BOS has no place in a completion
)
def test_special_token_inside_completion_is_rejected(toks, src, ids, message):
    with pytest.raises(SpecialTokenError, match=message):
        Bridge(toks[src], toks["gpt2"])(ids)


def test_literal_special_token_text_stays_text(toks):
    ids = ids_of(toks["gpt2"], "a<|im_end|>b<|endoftext|>")  # GPT-2 spells both as plain text tokens
    assert GPT2_EOS in ids  # ...except its own EOS string, which its encode turns into the control token
    text_ids = toks["gpt2"].encode("a<|im_end|>b<|endoftext|>", add_special_tokens=False, split_special_tokens=True)
    out = Bridge(toks["gpt2"], toks["qwen2"])(text_ids)
    assert out.text == "a<|im_end|>b<|endoftext|>"
    assert QWEN_IM_END not in out.dst_ids.tolist() and QWEN_EOS not in out.dst_ids.tolist()


# -- bytes, normalisation ------------------------------------------------------------------------


def test_completion_cut_inside_a_character_is_counted(toks):
    ids = ids_of(toks["gpt2"], "ok 🫠")
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    with pytest.raises(UndecodableTextError, match="invalid UTF-8 at byte 3 of"):
        bridge(ids[:-1])
    assert bridge.stats.undecodable == 1 and bridge.stats.rejected == 1


def test_byte_tokens_of_one_character_form_one_group(toks):
    gpt2_ids = ids_of(toks["gpt2"], "🫠")  # byte-level pieces of one 4-byte character
    out = Bridge(toks["gpt2"], toks["mistral"])(gpt2_ids, np.full(len(gpt2_ids), -0.25))
    assert len(gpt2_ids) > 1 and toks["mistral"].convert_ids_to_tokens(out.dst_ids.tolist())[-1].startswith("<0x")
    last = len(out.groups) - 1  # the emoji: all its GPT-2 pieces against all its Mistral byte-fallback pieces
    assert out.groups.src[last + 1] - out.groups.src[last] == len(gpt2_ids)
    assert out.dst_logprobs[out.dst_group == last].sum() == pytest.approx(-0.25 * len(gpt2_ids))
    assert out.residual == 1.0


def test_nfc_destination_never_splits_a_composed_character(toks):
    text = "xa\u0308\u0323y caf\u0065\u0301"  # reordered and composed under NFC
    out = Bridge(toks["gpt2"], toks["qwen2"])(ids_of(toks["gpt2"], text))
    assert out.dst_ids.tolist() == toks["qwen2"].encode(text)
    chars = out.groups.chars.tolist()
    assert 2 not in chars and 3 not in chars and 12 not in chars  # inside "a\u0308\u0323" and "e\u0301"


def test_destination_with_gaps_uses_offsets(toks):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # drops spaces: offsets with gaps
    words = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    out = Bridge(toks["gpt2"], words)(ids_of(toks["gpt2"], "hello  world!"))
    assert out.dst_ids.tolist() == [1, 2, 3]
    # the dropped spaces join the token before them, so "hello  world" is one (inexact) group
    assert out.groups.src.tolist() == [0, 3, 4] and out.groups.dst.tolist() == [0, 2, 3]
    assert out.groups.chars.tolist() == [0, 12, 13] and out.residual == pytest.approx(12 / 13)
    with pytest.raises(UnsupportedTokenizerError, match="cannot be a THL source"):
        Bridge(words, toks["gpt2"])


# -- identity, cache, mask, read-only ------------------------------------------------------------


def test_same_tokenizer_is_identity_even_for_non_canonical_ids(toks, tmp_path_factory):
    again = load_tokenizer("gpt2", tmp_path_factory.getbasetemp() / "tokenbridge-cache")  # another object
    bridge = Bridge(toks["gpt2"], again)
    non_canonical = [39, 695, 78]  # "H" "ell" "o" instead of "Hello"
    out = bridge(non_canonical, [-1.0, -2.0, -3.0])
    assert out.identity and out.residual == 0.0 and out.text == "Hello"
    assert out.dst_ids.tolist() == non_canonical and out.dst_logprobs.tolist() == [-1.0, -2.0, -3.0]


def test_cache_hits_reuse_alignment_and_respread_logprobs(toks):
    bridge = Bridge(toks["mistral"], toks["qwen2"], cache_size=2)
    ids = ids_of(toks["mistral"], "cached completion text")
    first = bridge(ids, np.full(len(ids), -1.0))
    second = bridge(np.array(ids, dtype=np.int32), np.full(len(ids), -2.0))
    assert bridge.stats.cache_hits == 1 and second.dst_ids is first.dst_ids
    assert second.dst_logprobs.sum() == pytest.approx(2 * first.dst_logprobs.sum())
    bridge(ids_of(toks["mistral"], "other one"))
    bridge(ids_of(toks["mistral"], "third one"))  # evicts the first (LRU, size 2)
    bridge(ids)
    assert bridge.stats.cache_hits == 1 and bridge.stats.bridged == 5


def test_returned_id_arrays_are_read_only(g2m):
    out = g2m([15496, 995])
    with pytest.raises(ValueError):
        out.dst_ids[0] = 0


def test_mask_is_all_of_the_group(toks):
    ids = ids_of(toks["gpt2"], "🫠 fine")
    mask = np.ones(len(ids), dtype=bool)
    mask[1] = False  # one byte piece of the emoji
    out = Bridge(toks["gpt2"], toks["qwen2"])(ids, mask=mask)
    emoji_group = out.src_group[1]
    assert not out.dst_mask[out.dst_group == emoji_group].any()
    assert out.dst_mask[out.dst_group != emoji_group].all()


def test_stats_accumulate_residual(toks):
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    out = bridge(ids_of(toks["gpt2"], "Hello world, 中文"))
    assert bridge.stats.chars == len(out.text)
    assert bridge.stats.residual_chars == pytest.approx(out.residual * len(out.text))


# -- learner sequence ----------------------------------------------------------------------------


def test_build_learner_sequence(toks, g2m):
    prompt = toks["mistral"].encode("[INST] 2+2? [/INST]")
    ids = ids_of(toks["gpt2"], " 4") + [GPT2_EOS]
    out = g2m(ids, [-0.5, -0.1])
    input_ids, loss_mask, behaviour = build_learner_sequence(prompt, out)
    assert input_ids.tolist() == prompt + out.dst_ids.tolist() and input_ids[-1] == MISTRAL_EOS
    assert loss_mask.tolist() == [False] * len(prompt) + [True] * len(out.dst_ids)
    assert behaviour[: len(prompt)].tolist() == [0.0] * len(prompt)
    assert behaviour.sum() == pytest.approx(-0.6)
    assert build_learner_sequence(prompt, g2m(ids))[2] is None
    with pytest.raises(InvalidTokenIdError, match="prompt_ids must be a 1-D sequence of integer ids"):
        build_learner_sequence([[1, 2]], out)


def test_readme_example(toks):
    """The example printed in tokenbridge/README.md."""
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    src_ids = ids_of(toks["gpt2"], "Hello wörld 🙂") + [GPT2_EOS]
    assert src_ids == [15496, 266, 30570, 335, 32485, 50256]
    out = bridge(src_ids, [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    assert out.text == "Hello wörld 🙂"
    assert out.dst_ids.tolist() == [22557, 275, 2024, 417, 28705, 29340, 2]
    assert out.groups.src.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert out.groups.dst.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert out.groups.chars.tolist() == [0, 5, 7, 9, 11, 13, 13]
    assert out.dst_group.tolist() == [0, 1, 2, 3, 4, 4, 5]
    np.testing.assert_allclose(out.dst_logprobs, [-0.1, -0.2, -0.3, -0.4, -0.25, -0.25, -0.6])
    assert out.residual == pytest.approx(2 / 13)
