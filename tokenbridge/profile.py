"""What the bridge needs to know about one tokenizer: the exact bytes of every token id.

A completion's text is the concatenation of its tokens' bytes (byte-level BPE: the GPT-2 byte map;
SentencePiece: "▁" is a space and "<0xNN>" is one raw byte), minus one leading space where the
decoder strips SentencePiece's dummy prefix. Knowing the bytes per id makes token boundaries a
cumulative sum, with no per-character work. A profile is verified against the tokenizer's own
decode on probe texts when built, so a tokenizer whose decode is not a byte concatenation is
marked `exact=False` instead of being silently misread.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Special tokens that end a completion; the engine may also pass its own EOS id.
END_TOKEN_TEXTS = frozenset(
    {"</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "<eos>"}
)
PROBE_TEXTS = (
    "Hello world",
    " leading space and  double  spaces ",
    "tabs\tand\nnew lines\r\n  indented",
    "中文字符, кириллица, العربية, emoji 😀👍🏽, e\u0301 combining",
    "def f(x):\n    return x ** 2  # 12345",
)
SPACE_MARKER = "\u2581"  # SentencePiece's "▁"
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


@dataclass(frozen=True, eq=False)
class VocabProfile:
    """Byte table and special-token facts of one tokenizer, indexed by token id."""

    token_bytes: tuple[bytes, ...]  # (V,) bytes each id contributes to the text; b"" for specials and holes
    byte_len: np.ndarray  # (V,) int64, len(token_bytes[i])
    blob: np.ndarray  # (sum byte_len,) uint8, all token bytes back to back (contiguous: cache-friendly gathers)
    blob_start: np.ndarray  # (V,) int64, where token i's bytes start in blob
    valid: np.ndarray  # (V,) bool, id exists in the vocabulary
    has_holes: bool  # some id below V is not in the vocabulary
    special: np.ndarray  # (V,) bool, control token with no text (BOS, EOS, <unk>, <|im_start|>, ...)
    end_ids: frozenset[int]  # special ids that may end a completion (EOS and friends)
    eos_id: int | None
    strips_leading_space: bool  # decode drops one leading space (SentencePiece dummy prefix)
    unicode_form: str | None  # the normalizer is exactly this Unicode form (Qwen2: "NFC"), else None
    composes: bool  # the normalizer may compose, decompose or reorder characters (any NF* inside it)
    exact: bool  # decode == concatenated token bytes on every probe text
    fingerprint: str  # sha256 of the serialized tokenizer: equal fingerprints tokenize identically

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def join(self, ids: list[int]) -> bytes:
        """Concatenated bytes of `ids` (before any leading-space strip)."""
        if not ids:
            return b""
        if len(ids) == 1:
            return self.token_bytes[ids[0]]
        return b"".join(itemgetter(*ids)(self.token_bytes))

    def gather(self, ids: np.ndarray) -> tuple[bytes, np.ndarray]:
        """(concatenated bytes of `ids`, (n,) int64 start byte of each token): numpy gathers, no Python loop."""
        lens = self.byte_len[ids]
        starts = np.cumsum(lens)
        starts -= lens
        index = np.repeat(self.blob_start[ids] - starts, lens)
        index += np.arange(len(index))
        return self.blob[index].tobytes(), starts


def _decoder_json(backend: Tokenizer) -> str:
    return backend.decoder.__getstate__().decode("utf-8") if backend.decoder is not None else "{}"


def _strips_leading_space(decoder: dict) -> bool:
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    for part in parts:
        if part.get("type") == "Strip" and part.get("content") == " " and part.get("start", 0) >= 1:
            return True
        if part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never":
            return True
    return False


def _token_to_bytes_fn(decoder_text: str):
    """A function token string -> bytes, chosen by the decoder family."""
    if '"ByteLevel"' in decoder_text:
        table = str.maketrans({ch: chr(b) for b, ch in bytes_to_unicode().items()})
        return lambda tok: tok.translate(table).encode("latin-1")
    byte_fallback = '"ByteFallback"' in decoder_text
    metaspace = SPACE_MARKER in decoder_text or '"Metaspace"' in decoder_text

    def spm_bytes(tok: str) -> bytes:
        if byte_fallback and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes([int(tok[3:5], 16)])
        return (tok.replace(SPACE_MARKER, " ") if metaspace else tok).encode("utf-8")

    return spm_bytes


def _build(tok: PreTrainedTokenizerFast) -> VocabProfile:
    backend = tok.backend_tokenizer
    decoder_text = _decoder_json(backend)
    to_bytes = _token_to_bytes_fn(decoder_text)
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    table: list[bytes] = [b""] * size
    valid = np.zeros(size, dtype=bool)
    special = np.zeros(size, dtype=bool)
    added = backend.get_added_tokens_decoder()
    for token, idx in vocab.items():
        valid[idx] = True
        if idx in added:
            if added[idx].special:
                special[idx] = True
            else:  # added non-special tokens are plain text, not byte-mapped
                table[idx] = added[idx].content.encode("utf-8")
        else:
            table[idx] = to_bytes(token)
    eos_id = tok.eos_token_id
    end_ids = {i for i, t in added.items() if t.special and t.content in END_TOKEN_TEXTS}
    if eos_id is not None:
        end_ids.add(int(eos_id))
    strips = _strips_leading_space(json.loads(decoder_text))
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else {}
    form = normalizer.get("type") if normalizer.get("type") in UNICODE_FORMS else None
    composes = any(f'"type":"{name}"' in json.dumps(normalizer, separators=(",", ":")) for name in UNICODE_FORMS)
    byte_len = np.fromiter(map(len, table), dtype=np.int64, count=size)
    profile = VocabProfile(
        token_bytes=tuple(table),
        byte_len=byte_len,
        blob=np.frombuffer(b"".join(table), dtype=np.uint8),
        blob_start=np.cumsum(byte_len) - byte_len,
        valid=valid,
        has_holes=not bool(valid.all()),
        special=special,
        end_ids=frozenset(end_ids),
        eos_id=None if eos_id is None else int(eos_id),
        strips_leading_space=strips,
        unicode_form=form,
        composes=composes,
        exact=False,
        fingerprint=hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest(),
    )
    return _verified(profile, backend)


def _verified(profile: VocabProfile, backend: Tokenizer) -> VocabProfile:
    """Mark the profile exact iff byte concatenation reproduces the tokenizer's decode on every probe."""
    for text in PROBE_TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        raw = profile.join(ids)
        if profile.strips_leading_space and raw.startswith(b" "):
            raw = raw[1:]
        try:
            if raw.decode("utf-8") != backend.decode(ids, skip_special_tokens=False):
                return profile
        except UnicodeDecodeError:
            return profile
    return VocabProfile(**{**profile.__dict__, "exact": True})


_PROFILES: "weakref.WeakKeyDictionary[PreTrainedTokenizerFast, VocabProfile]" = weakref.WeakKeyDictionary()


def profile_of(tok: PreTrainedTokenizerFast) -> VocabProfile:
    """The (cached) profile of a tokenizer; built once per tokenizer object (~0.5 s for a 150k vocabulary)."""
    try:
        return _PROFILES[tok]
    except KeyError:
        pass
    except TypeError:  # unhashable tokenizer subclass: no caching
        return _build(tok)
    profile = _build(tok)
    _PROFILES[tok] = profile
    return profile
