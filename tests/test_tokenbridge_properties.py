"""THL bridge properties over arbitrary unicode, for all ordered pairs of the three built-in tokenizers, and
SmolLM2-135M-Instruct's own with each of them both ways (tests/realtok.py).

Checked against the tokenizers' own encode/decode (never against the bridge's byte tables):
destination ids, exact and ordered group coverage, group texts, log-prob conservation, the mask
rule, and the residual against a brute-force character-by-character reference.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtok import NAMES, PAIRS, load_test_tokenizer, refused_rightly, spells

from tokenbridge import Bridge, BridgeError

FRAGMENTS = (
    "😀", "👍🏽", "🫠", "👨‍👩‍👧", "中文", "字符。", "кириллица", "العربية",  # emoji (ZWJ, modifiers), CJK, scripts
    "e\u0301", "a\u0308\u0323", "\u0301", "Å", "ﬁ", "𝔸𝕓",  # combining marks, NFC-changing, compatibility
    "  ", "\t", "\n\n", "\r\n", "   \n ", " ", "\u3000", "\u00a0",  # whitespace runs
    "0123456789", "3.14159", "x**2 + y_1", "def f(x):\n    return x", "{}[]();", "'s", "'LL",  # digits, code
    "\u2581", "<s>", "\x00",  # SentencePiece's marker, a special-token string, NUL
)
CHARS = st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd")
TEXTS = st.lists(
    st.one_of(st.text(CHARS, max_size=10), st.sampled_from(FRAGMENTS)), min_size=1, max_size=10
).map("".join)
SETTINGS = settings(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    return {name: load_test_tokenizer(name, cache) for name in NAMES}


@pytest.fixture(scope="module")
def bridges(toks):
    return {(s, d): Bridge(toks[s], toks[d], cache_size=64) for s, d in PAIRS}


def encode(tok, text: str) -> list[int]:
    """The tokenizer's own encoding of a completion: no BOS, literal special-token strings kept as text."""
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def decoded_view(name: str, text: str) -> str:
    """What a tokenizer's decode gives back for text it encoded: Qwen2 normalises to NFC, Mistral's
    decoder turns the SentencePiece marker U+2581 into a space."""
    if name == "qwen2":
        return unicodedata.normalize("NFC", text)
    if name == "mistral":
        return text.replace("\u2581", " ")
    return text


def group_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return np.array([values[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda p: str(p))
@SETTINGS
@given(text=TEXTS, seed=st.integers(0, 2**32 - 1))
def test_bridge_properties(toks, bridges, src, dst, text, seed):
    src_tok, dst_tok = toks[src], toks[dst]
    ids = encode(src_tok, text)
    if not ids or (src == dst and not spells(src_tok, text)):  # identity passes ids through, whatever they spell
        return
    rng = np.random.default_rng(seed)
    logprobs = -rng.exponential(2.0, size=len(ids)).astype(np.float32)
    mask = rng.random(len(ids)) > 0.1
    try:
        out = bridges[src, dst](np.array(ids, dtype=np.int32), logprobs, mask)
    except BridgeError as exc:  # SmolLM2's vocabulary cannot spell every text
        assert refused_rightly(exc, src_tok, dst_tok, ids), exc
        return

    assert out.text == src_tok.decode(ids)
    assert out.dst_ids.tolist() == encode(dst_tok, out.text)
    if src == dst:
        assert out.identity and out.residual == 0.0 and out.dst_ids.tolist() == ids
    # groups cover both sequences and the text exactly, in order, with no empty side
    g = out.groups
    assert g.src[0] == 0 and g.src[-1] == len(ids) and (np.diff(g.src) >= 1).all()
    assert g.dst[0] == 0 and g.dst[-1] == len(out.dst_ids) and (np.diff(g.dst) >= 1).all()
    assert g.chars[0] == 0 and g.chars[-1] == len(out.text) and (np.diff(g.chars) >= 0).all()
    assert (out.src_group == np.repeat(np.arange(len(g)), np.diff(g.src))).all()
    assert (out.dst_group == np.repeat(np.arange(len(g)), np.diff(g.dst))).all()
    # every group boundary is a prefix of the text on both sides (decoded by the tokenizers themselves)
    if not out.identity:
        for k_src, k_dst, c in zip(g.src, g.dst, g.chars):
            assert src_tok.decode(ids[:k_src]) == out.text[:c]
            assert dst_tok.decode(out.dst_ids[:k_dst].tolist()) == decoded_view(dst, out.text[:c])
    # log-prob sums conserved per group; mask: a group trains only if all its source tokens did
    src_sums = group_sums(logprobs.astype(np.float64), g.src)
    np.testing.assert_allclose(group_sums(out.dst_logprobs, g.dst), src_sums, rtol=0, atol=1e-6)
    group_mask = np.array([mask[a:b].all() for a, b in zip(g.src[:-1], g.src[1:])])
    assert (out.dst_mask == group_mask[out.dst_group]).all()
    # residual: the characters of groups that are not one-to-one
    assert 0.0 <= out.residual <= 1.0
    if out.text and not out.identity:
        inexact = ~g.one_to_one()
        assert out.residual == pytest.approx(np.diff(g.chars)[inexact].sum() / len(out.text), abs=1e-12)


def reference_cuts(decode, ids: list[int], text: str) -> dict[int, int]:
    """Character position -> number of tokens after which the decoded prefix is exactly text[:position]
    (the first such count; the whole sequence at the end). Quadratic, by design."""
    cuts: dict[int, int] = {}
    for k in range(len(ids) + 1):
        prefix = decode(ids[:k])
        if text.startswith(prefix):
            cuts.setdefault(len(prefix), k)
    assert cuts.get(len(text), -1) >= 0, "the tokens do not decode to the text"
    cuts[len(text)] = len(ids)
    return cuts


def reference_residual(text: str, src_ids: list[int], dst_ids: list[int], src_decode, dst_decode, dst: str) -> float:
    """Brute force, character by character: a character is inexact if its group (the span between the
    nearest cuts shared by both sides) does not hold exactly one token on each side."""
    src_cuts = reference_cuts(src_decode, src_ids, text)
    dst_cuts = reference_cuts(dst_decode, dst_ids, decoded_view(dst, text))
    common = sorted(set(src_cuts) & set(dst_cuts))
    inexact = 0
    for c in range(len(text)):
        start = max(p for p in common if p <= c)
        end = min(p for p in common if p > c)
        n_src = src_cuts[end] - src_cuts[start]
        n_dst = dst_cuts[end] - dst_cuts[start]
        inexact += n_src != 1 or n_dst != 1
    return inexact / len(text)


SMALL_TEXTS = st.lists(st.one_of(st.text(CHARS, max_size=6), st.sampled_from(FRAGMENTS)), min_size=1, max_size=4).map(
    lambda parts: unicodedata.normalize("NFC", "".join(parts))  # NFC: every tokenizer's decode is then a text prefix
)


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda p: str(p))
@SETTINGS
@given(text=SMALL_TEXTS)
def test_residual_matches_brute_force_reference(toks, bridges, src, dst, text):
    src_tok, dst_tok = toks[src], toks[dst]
    ids = encode(src_tok, text)
    if not ids:
        return
    try:
        out = bridges[src, dst](ids)
    except BridgeError as exc:  # SmolLM2's vocabulary cannot spell every text
        assert refused_rightly(exc, src_tok, dst_tok, ids), exc
        return
    if not out.text:
        return
    if src == dst:
        assert out.residual == 0.0
        return
    expected = reference_residual(out.text, ids, encode(dst_tok, out.text), src_tok.decode, dst_tok.decode, dst)
    assert out.residual == pytest.approx(expected, abs=1e-12)
