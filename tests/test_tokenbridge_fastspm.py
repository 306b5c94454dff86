"""THL's tiktoken encode for SentencePiece BPE destinations (tokenbridge/fastspm.py): the same ids as the
destination's own `tokenizers` encode (Mistral's), checked exhaustively where the two could part (words cut
at spaces, characters merged from bytes, byte fallback for characters that are no piece, whole-word
lookups, the merge rule), and refused for destinations outside its conditions."""

from __future__ import annotations

import copy
import json
import random

import pytest

from tokenbridge import Bridge, load_tokenizer
from tokenbridge.encoders import CHECK_TEXTS, encoders_for
from tokenbridge.fastspm import sentencepiece_ids
from tokenbridge.loading import _build_mistral, _package_file
from tokenbridge.profile import profile_of

EDGES = (
    "", " ", "  ", "x", " x", "  x", "x ", "x  ", "a  b   c", "\u2581", "\u2581x", "x\u2581y", " \u2581 ", "\u2581\u2581",
    "\n", "\n\n    x = 1\n", "\t\tx", "\r\n", "\x00", "\x01b", "</s>", "<s> <unk>", "<0x41>",
    "苹果", "\U0001fae0", "\U0001f600\U0001f44d\U0001f3fd", "\u00e9\u00e8", "e\u0301", "\ufb01", "\u3000x\u00a0y",
    "한국어 텍스트", "∑_{i=1} √2 ≈ 1.414", "۰١٢", "𝔸𝕓 Ω",
)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    tok = load_tokenizer("mistral", tmp_path_factory.getbasetemp() / "tokenbridge-cache")
    return tok, encoders_for(tok.backend_tokenizer, profile_of(tok))


def own_ids(enc, texts: list[str]) -> list[list[int]]:
    """The destination's own encode (normaliser included) that the fast one stands in for."""
    return [e.ids for e in enc.full.encode_batch_fast(texts, add_special_tokens=False)]


def wrong_texts(enc, texts: list[str]) -> list[str]:
    return [text for text, ids in zip(texts, own_ids(enc, texts)) if enc.fast(text) != ids]


def test_mistral_gets_the_encode_and_byte_level_destinations_are_refused_it(mistral, tmp_path_factory):
    assert mistral[1].fast is not None
    for name in ("gpt2", "qwen2"):
        tok = load_tokenizer(name, tmp_path_factory.getbasetemp() / "tokenbridge-cache")
        enc = encoders_for(tok.backend_tokenizer, profile_of(tok))
        assert sentencepiece_ids(json.loads(enc.full.to_str()), profile_of(tok).token_bytes, enc.full, CHECK_TEXTS) is None


def test_edge_texts_encode_as_the_destination_does(mistral):
    """Empty text, runs of spaces at either end, a literal "▁" (the destination reads it as a space),
    special-token strings as text, characters that are no piece (byte fallback, some sharing their first
    bytes with a piece), combining marks, NUL and control characters."""
    _, enc = mistral
    texts = list(EDGES) + ["".join(pair) for pair in zip(EDGES, reversed(EDGES))]
    assert not wrong_texts(enc, texts)


@pytest.mark.slow
def test_every_codepoint_in_every_context_is_merged_as_the_destination_does(mistral):
    """Each codepoint (surrogates aside) between letters, digits, spaces, a "▁", a newline and an apostrophe."""
    _, enc = mistral
    codepoints = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    texts = []
    for at in range(0, len(codepoints), 256):
        chunk = (chr(c) for c in codepoints[at : at + 256])
        texts.append("".join(f"a{c}b {c}{c}1{c}  {c}\n{c}'s\u2581{c} " for c in chunk))
    assert not wrong_texts(enc, texts)


def test_every_piece_alone_and_random_joins_of_pieces_encode_as_the_destination_does(mistral):
    """Whole words that are pieces (tiktoken takes them whole), and words whose merges meet across pieces,
    with the spaces of pieces that start with "▁" deciding where words are cut."""
    tok, enc = mistral
    spelled = [raw.decode("utf-8", "ignore") for raw in profile_of(tok).token_bytes]
    pieces = [piece for piece in spelled if piece]
    rng = random.Random(0)
    joins = ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 5))) for _ in range(30_000)]
    assert not wrong_texts(enc, pieces + [piece.lstrip(" ") for piece in pieces] + joins)


def test_a_whole_completion_encodes_as_the_destination_does(mistral):
    """A bridged text end to end: the bridge's destination ids are the destination's own."""
    tok, enc = mistral
    gpt2 = load_tokenizer("gpt2")
    text = "Let's think: 12 × 7 = 84.\n```python\ndef f(x):\n    return x  # 苹果 😀\n```\n  Ответ: 84  "
    out = Bridge(gpt2, tok, cache_size=0)(gpt2.encode(text))
    assert out.dst_ids.tolist() == tok.encode(text, add_special_tokens=False) == enc.fast(text)


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("change", [
    "ignore_merges", "merges of one piece apart", "a split that is no merge", "a missing byte token",
    "another normaliser", "a piece with a space inside", "an added token that is not special", "a merge dropout",
])
def test_a_destination_outside_the_conditions_keeps_the_tokenizers_encode(mistral, change):
    tok, enc = mistral
    config = json.loads(enc.full.to_str())
    token_bytes = profile_of(tok).token_bytes
    assert sentencepiece_ids(copy.deepcopy(config), token_bytes, enc.full, CHECK_TEXTS) is not None
    model = config["model"]
    merges = model["merges"]
    if change == "ignore_merges":
        model["ignore_merges"] = True
    elif change.startswith("merges of one piece"):  # "▁the" has several merges: move one to the end
        at = next(k for k, m in enumerate(merges) if "".join(m) == "\u2581the")
        merges.append(merges.pop(at))
    elif change.startswith("a split"):
        at = next(k for k, m in enumerate(merges) if "".join(m) == "\u2581the")
        merges.pop(at)
    elif change.startswith("a missing byte"):
        model["vocab"]["<0x41>x"] = model["vocab"].pop("<0x41>")
    elif change.startswith("another"):
        config["normalizer"] = {"type": "NFKC"}
    elif change.startswith("a piece with"):
        model["vocab"]["a\u2581b"] = len(model["vocab"])
        merges.append(["a", "\u2581b"])
        token_bytes = token_bytes + (b"a b",)
    elif change.startswith("an added"):
        config["added_tokens"].append({"id": 31999, "content": "[INST]", "special": False})
    else:
        model["dropout"] = 0.1
    assert sentencepiece_ids(config, token_bytes, enc.full, CHECK_TEXTS) is None


@pytest.mark.parametrize("model_file, fast", [
    ("mistral_instruct_tokenizer_240216.model.v2", True),  # 32768 pieces, 771 control tokens
    ("mistral_instruct_tokenizer_240323.model.v3", False),  # a Split pre-tokenizer for its [REFERENCE_DOC_n] symbols
])
def test_other_sentencepiece_vocabularies_get_the_encode_where_it_holds(model_file, fast):
    """Mistral's later SentencePiece models (shipped in mistral-common), converted as load_tokenizer converts v1."""
    tok = _build_mistral({"model": _package_file("mistral_common", "data", model_file)})
    enc = encoders_for(tok.backend_tokenizer, profile_of(tok))
    assert (enc.fast is not None) is fast
    if fast:
        pieces = [raw.decode("utf-8", "ignore") for raw in profile_of(tok).token_bytes if raw]
        rng = random.Random(1)
        joins = ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 6))) for _ in range(10_000)]
        assert not wrong_texts(enc, pieces + joins + list(EDGES))
