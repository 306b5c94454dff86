"""THL fast path: the inputs that spelling texts from per-token tables makes risky, each checked against
the tokenizers' own encode/decode (never against the bridge's tables), on every ordered pair."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtok import EOS, NAMES, PAIRS, load_test_tokenizer, refused_rightly, spells

from tokenbridge import Bridge, BridgeError, UndecodableTextError, load_tokenizer

RISKY = (
    "🫠", "👨‍👩‍👧", "naïve café", "中文字符", "𝔸𝕓",  # byte-level tokens holding part of a character
    " leading space", "  two", "\u2581", "x\u2581y", "\u2581\u2581 marker",  # SentencePiece's space marker
    "e\u0301", "a\u0308\u0323", "\u212b", "\uf900", "ﬁ",  # NFC changes these: the normalised path
    "\U0001fae0\U00010348", "ʬʭ", "\x00\x01",  # rare characters: SentencePiece byte fallback
    " " * 20, "-" * 40, " internationalization", "\n" + " " * 24 + "return", "\t" * 12,  # longer than a row
    "<s>", "</s>", "<|im_end|>", "<|endoftext|>",  # special-token strings stay text
    "ÿþ", "0123456789", "'s 'LL",
)
TEXTS = st.lists(st.one_of(st.sampled_from(RISKY), st.text(max_size=6)), min_size=1, max_size=8).map("".join)
SETTINGS = settings(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    return {name: load_test_tokenizer(name, cache) for name in NAMES}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def decoded_view(name: str, text: str) -> str:
    """What a tokenizer's decode gives back for text it encoded (Qwen2: NFC; Mistral: U+2581 is a space)."""
    if name == "qwen2":
        return unicodedata.normalize("NFC", text)
    return text.replace("\u2581", " ") if name == "mistral" else text


def check(out, toks, src: str, dst: str, ids: list[int], n_end: int) -> None:
    """The bridge's result against the tokenizers themselves."""
    body = ids[: len(ids) - n_end]
    assert out.text == toks[src].decode(body)
    assert out.dst_ids.tolist() == encode(toks[dst], out.text) + ([EOS[dst]] if n_end else [])
    g = out.groups
    assert g.src[0] == 0 and g.src[-1] == len(ids) and (np.diff(g.src) >= 1).all()
    assert g.dst[0] == 0 and g.dst[-1] == len(out.dst_ids) and (np.diff(g.dst) >= 1).all()
    assert g.chars[-1] == len(out.text) and (out.src_group == np.repeat(np.arange(len(g)), np.diff(g.src))).all()
    assert (out.dst_group == np.repeat(np.arange(len(g)), np.diff(g.dst))).all()
    if src != dst:
        for k_src, k_dst, c in zip(g.src, g.dst, g.chars):
            assert toks[src].decode(ids[: min(k_src, len(body))]) == out.text[:c]
            dst_body = out.dst_ids[: min(k_dst, len(out.dst_ids) - bool(n_end))].tolist()
            assert toks[dst].decode(dst_body) == decoded_view(dst, out.text[:c])


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda p: str(p))
@pytest.mark.parametrize("text", RISKY, ids=lambda t: repr(t)[:24])
def test_risky_text_alone_and_with_eos(toks, src, dst, text):
    ids = encode(toks[src], text)
    if not ids or toks[src].decode(ids) == "":
        return
    bridge = Bridge(toks[src], toks[dst])
    for n_end in (0, 1):
        full = ids + [EOS[src]] * n_end
        try:
            out = bridge(full)
        except BridgeError as exc:  # SmolLM2's vocabulary cannot spell every text
            assert refused_rightly(exc, toks[src], toks[dst], ids), exc
            continue
        check(out, toks, src, dst, full, n_end)


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda p: str(p))
@SETTINGS
@given(texts=st.lists(TEXTS, min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1))
def test_risky_texts_in_a_batch(toks, src, dst, texts, seed):
    """Every completion of a batch is what one call gives, and passes the same checks."""
    rng = np.random.default_rng(seed)
    runs = []
    for text in texts:
        n_end = int(rng.integers(0, 2))
        ids = encode(toks[src], text) + [EOS[src]] * n_end
        if ids and (src != dst or spells(toks[src], text)):  # identity passes ids through, whatever they spell
            runs.append((ids, n_end, -rng.exponential(1.0, len(ids))))
    if not runs:
        return
    outs = Bridge(toks[src], toks[dst], cache_size=0).batch([ids for ids, _, _ in runs], [lp for _, _, lp in runs])
    single = Bridge(toks[src], toks[dst], cache_size=0)
    for (ids, n_end, lp), out in zip(runs, outs):
        if isinstance(out, BridgeError):  # SmolLM2's vocabulary cannot spell every text
            assert refused_rightly(out, toks[src], toks[dst], ids[: len(ids) - n_end]), out
            with pytest.raises(type(out)):
                single(ids, lp)
            continue
        one = single(ids, lp)
        assert out.dst_ids.tolist() == one.dst_ids.tolist() and out.residual == one.residual
        assert out.dst_logprobs.tobytes() == one.dst_logprobs.tobytes()
        check(out, toks, src, dst, ids, n_end)


def test_sentencepiece_marker_alone_first(toks):
    """Mistral ids "▁" "Hello": the marker token holds only the stripped dummy-prefix space."""
    out = Bridge(toks["mistral"], toks["gpt2"])([28705, 16230], [-1.0, -2.0])
    assert out.text == toks["mistral"].decode([28705, 16230]) == "Hello"
    assert out.groups.src.tolist() == [0, 2] and out.dst_logprobs.sum() == pytest.approx(-3.0)


def test_eos_override_that_is_a_text_token_adds_no_text(toks):
    ids = encode(toks["gpt2"], "The answer is 42.") + [EOS["gpt2"]]
    plain = Bridge(toks["gpt2"], toks["mistral"])(ids)
    out = Bridge(toks["gpt2"], toks["mistral"], dst_eos_id=1318)(ids)  # "▁x", a text token
    assert out.dst_ids.tolist() == plain.dst_ids.tolist()[:-1] + [1318]
    assert out.groups.chars.tolist() == plain.groups.chars.tolist() and out.residual == plain.residual


def test_token_holding_0xff_is_undecodable(toks):
    """A byte-level token of 0xFF (never in valid UTF-8; also the padding byte of the bridge's tables)."""
    bridge = Bridge(toks["gpt2"], toks["mistral"])
    with pytest.raises(UndecodableTextError):
        bridge(encode(toks["gpt2"], "ok") + [187])
    outs = bridge.batch([[187], encode(toks["gpt2"], "fine")])
    assert isinstance(outs[0], UndecodableTextError) and outs[1].text == "fine"


def test_token_longer_than_the_tables_hold(toks, tmp_path_factory):
    """An added token of 300 characters (600 bytes): past what a text row and a meta row can hold."""
    big = load_tokenizer("gpt2", tmp_path_factory.getbasetemp() / "tokenbridge-cache")
    big.add_tokens(["\u03bb" * 300])
    text = "ok " + "\u03bb" * 300 + " done \u03bb"
    ids = encode(big, text)
    assert len(ids) < 10  # the long token is used
    for src, dst in ((big, toks["qwen2"]), (toks["qwen2"], big), (big, toks["mistral"])):
        src_ids = encode(src, text)
        out = Bridge(src, dst)(src_ids + [src.eos_token_id], np.full(len(src_ids) + 1, -0.5))
        assert out.text == text and out.dst_ids.tolist() == encode(dst, text) + [dst.eos_token_id]
        assert out.groups.chars[-1] == len(text) and out.dst_logprobs.sum() == pytest.approx(-0.5 * (len(src_ids) + 1))
        for k_src, c in zip(out.groups.src[:-1], out.groups.chars[:-1]):
            assert src.decode(src_ids[:k_src]) == text[:c]
