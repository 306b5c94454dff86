"""THL's tiktoken encode (tokenbridge/fastbpe.py): the same ids as the destination's `tokenizers` encode,
checked exhaustively where tiktoken and `tokenizers` could part (the regex engines' Unicode classes, the
merge rule, whole-word lookups), and refused for destinations outside its conditions."""

from __future__ import annotations

import copy
import json
import random
import unicodedata

import pytest
from tokenizers import Tokenizer

from tokenbridge import load_tokenizer
from tokenbridge.encoders import CHECK_TEXTS, encoders_for
from tokenbridge.fastbpe import tiktoken_ids
from tokenbridge.profile import profile_of

FAST = ("gpt2", "qwen2")  # byte-level BPE: GPT-2's regex and Qwen2's


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    out = {}
    for name in ("gpt2", "mistral", "qwen2"):
        tok = load_tokenizer(name, cache)
        out[name] = (tok, encoders_for(tok.backend_tokenizer, profile_of(tok)))
    return out


def reference_ids(enc, texts: list[str]) -> list[list[int]]:
    """The `tokenizers` encode that the fast one stands in for (no normalizer: the texts are NFC)."""
    return [e.ids for e in enc.plain.encode_batch_fast(texts, add_special_tokens=False)]


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_byte_level_destinations_get_this_encode_and_sentencepiece_is_refused_it(encoders):
    """Mistral's SentencePiece BPE has an encode of its own (tests/test_tokenbridge_fastspm.py)."""
    for name, expected in (("gpt2", True), ("qwen2", True), ("mistral", False)):
        tok, enc = encoders[name]
        config = json.loads(enc.full.to_str())
        assert (tiktoken_ids(config, profile_of(tok).token_bytes, enc.plain, CHECK_TEXTS) is not None) is expected
        assert enc.fast is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_every_codepoint_in_every_context_is_cut_and_merged_as_tokenizers_does(encoders, name):
    """Each codepoint (surrogates aside) between letters, digits, spaces, newlines and an apostrophe, NFC."""
    _, enc = encoders[name]
    codepoints = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    texts = []
    for at in range(0, len(codepoints), 256):
        chunk = (chr(c) for c in codepoints[at : at + 256])
        texts.append(unicodedata.normalize("NFC", "".join(f"a{c}b {c}{c}1{c} {c}\n{c}'s " for c in chunk)))
    expected = reference_ids(enc, texts)
    wrong = [texts[i][:8] for i, text in enumerate(texts) if enc.fast(text) != expected[i]]
    assert not wrong


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("name", FAST)
def test_every_token_alone_and_random_joins_of_tokens_encode_as_tokenizers_does(encoders, name):
    """Whole words that are tokens (tiktoken takes them whole) and words whose merges meet across tokens."""
    tok, enc = encoders[name]
    spelled = [raw.decode("utf-8", "ignore") for raw in profile_of(tok).token_bytes]
    words = [w for w in spelled if w and unicodedata.is_normalized("NFC", w)]
    letters = [w for w in words if w.isalpha()]
    rng = random.Random(0)
    words += ["".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(30_000)]
    words = [w for w in words if unicodedata.is_normalized("NFC", w)]
    expected = reference_ids(enc, words)
    wrong = [w for w, ids in zip(words, expected) if enc.fast(w) != ids]
    assert not wrong, wrong[:5]


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("change", [
    "a pattern it has not been checked with", "a normalizer other than NFC", "an added token that is not special",
    "merges out of rank order", "a merge dropout",
])
def test_a_destination_outside_the_conditions_keeps_the_tokenizers_encode(encoders, change):
    tok, enc = encoders["qwen2"]
    config = json.loads(enc.full.to_str())
    assert tiktoken_ids(copy.deepcopy(config), profile_of(tok).token_bytes, enc.plain, CHECK_TEXTS) is not None
    if change.startswith("a pattern"):
        config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = config["pre_tokenizer"]["pretokenizers"][0][
            "pattern"]["Regex"].replace("\\p{N}|", "\\p{N}{1,3}|")  # Llama 3's digits
    elif change.startswith("a normalizer"):
        config["normalizer"] = {"type": "Lowercase"}
    elif change.startswith("an added"):
        config["added_tokens"].append({"id": 151646, "content": "<tool_call>", "special": False})
    elif change.startswith("merges"):
        merges = config["model"]["merges"]
        merges[0], merges[-1] = merges[-1], merges[0]
    else:
        config["model"]["dropout"] = 0.1
    assert tiktoken_ids(config, profile_of(tok).token_bytes, enc.plain, CHECK_TEXTS) is None


def test_a_vocabulary_whose_tokens_do_not_merge_to_themselves_keeps_the_tokenizers_encode(encoders):
    """GPT-2 runs its merges even on a word that is a token: without the merge that makes " the", the word
    " the" no longer encodes to that token, and tiktoken (which would take it whole) is refused."""
    tok, enc = encoders["gpt2"]
    config = json.loads(enc.full.to_str())
    merges = config["model"]["merges"]
    the = next(m for m in merges if (m if isinstance(m, str) else " ".join(m)) == "\u0120t he")
    merges.remove(the)
    plain = Tokenizer.from_str(json.dumps(config))
    assert tiktoken_ids(config, profile_of(tok).token_bytes, plain, CHECK_TEXTS) is None
