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
# What spelling reads per token: its bytes in a text row, padded to 16 with 0xFF (a byte valid UTF-8 never
# holds, so dropping it from the row bytes leaves the text), and a flag byte. Lengths and lead bytes come
# from the int64 tables themselves: one gather each, no casts (at these lengths every distinct numpy
# operation costs more than the data it moves, most of all when the destination encode has just
# evicted the caches).
ROW = 16  # token bytes a text row holds
PAD = b"\xff"
SPECIAL, STARTS_CHAR, SLOW, INVALID = 1, 2, 4, 8  # flag bits; SLOW: longer than a row, or holding 0xFF: spelled
# from the blob; INVALID: not in the vocabulary (only in `record`)
# `record` packs what the compiled fast path reads per id into one int64 (one cache line per token, not four):
LEN_SHIFT, START_SHIFT, MAX_TOKEN_BYTES = 8, 24, 0xFFFF  # [flags | byte length << 8 | blob start << 24, first 8 bytes]
INLINE_BYTES = 8
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


@dataclass(frozen=True, eq=False)
class VocabProfile:
    """Byte table and special-token facts of one tokenizer, indexed by token id."""

    token_bytes: tuple[bytes, ...]  # (V,) bytes each id contributes to the text; b"" for specials and holes
    byte_len: np.ndarray  # (V,) int64, len(token_bytes[i])
    rows: np.ndarray  # (V, ROW) uint8, token bytes padded with 0xFF (the first ROW of them for a SLOW token)
    flag: np.ndarray  # (V,) uint8 flag bits (SPECIAL, STARTS_CHAR, SLOW)
    lead_bytes: np.ndarray  # (V,) int64, bytes of token i that start a UTF-8 character (its share of the characters)
    blob: np.ndarray  # (sum byte_len,) uint8, all token bytes back to back, for tokens longer than a record holds
    blob_start: np.ndarray  # (V,) int64, where token i's bytes start in blob
    record: np.ndarray  # (V, 2) int64: flags (INVALID: a hole) | byte_len << LEN_SHIFT | blob_start << START_SHIFT; the
    # token's bytes if it has at most INLINE_BYTES (16 bytes a token, aligned: one cache line per lookup)
    inline: np.ndarray  # (V, 16) uint8 view of record
    valid: np.ndarray  # (V,) bool, id exists in the vocabulary
    has_holes: bool  # some id below V is not in the vocabulary
    has_empty: bool  # some text token has no bytes (so two tokens can start at one byte)
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
        spelled = self.spell(ids)
        return spelled.raw, spelled.bounds[:-1]

    def spell(self, ids: np.ndarray, empty_at: list[int] | tuple = (), text: bool = True) -> Spelled:
        """The bytes of `ids` back to back and where each token starts; tokens at `empty_at` count as no
        bytes (an EOS that stands for no text). Without `text`: only where the tokens start (no bytes, no
        flags). Row gathers: the text rows' bytes without their padding are the text; SLOW tokens (rare)
        send the whole run through the blob."""
        lens = self.byte_len.take(ids)
        for i in empty_at:
            lens[i] = 0
        if not text:
            return Spelled(b"", bounds_of(lens), None, 0)
        flags = self.flag.take(ids)
        any_flags = int(np.bitwise_or.reduce(flags))
        if any_flags & SLOW:
            index = (self.blob_start.take(ids) - bounds_of(lens)[:-1]).repeat(lens)  # blob position of a token's
            index += np.arange(len(index))  # start, plus the byte's offset in the text minus the token's start
            raw = self.blob.take(index).tobytes()
        else:
            rows = self.rows.take(ids, axis=0)
            for i in empty_at:
                rows[i] = PAD[0]
            raw = rows.tobytes().translate(None, PAD)
        return Spelled(raw, bounds_of(lens), flags, any_flags)


@dataclass(slots=True, eq=False)
class Spelled:
    """Token ids spelled out. Alignment rule: flags and bounds[:-1] share the ids' length."""

    raw: bytes  # the tokens' bytes back to back
    bounds: np.ndarray  # (n+1,) int64 start byte of each token, then len(raw)
    flags: np.ndarray | None  # (n,) uint8 token flags (SPECIAL, STARTS_CHAR, SLOW); None if no text was spelled
    any_flags: int  # the flags of all tokens or-ed (0 if no text was spelled)


def bounds_of(lens: np.ndarray) -> np.ndarray:
    """(n+1,) int64 running totals of int64 `lens`, from 0 (narrower input would sum through a slow buffered cast)."""
    bounds = np.empty(len(lens) + 1, dtype=np.int64)
    bounds[0] = 0
    np.add.accumulate(lens, out=bounds[1:])
    return bounds


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
    blob = np.frombuffer(b"".join(table), dtype=np.uint8)
    blob_start = np.cumsum(byte_len) - byte_len
    leads_before = np.zeros(len(blob) + 1, dtype=np.int64)
    np.cumsum((blob & 0xC0) != 0x80, out=leads_before[1:])  # continuation bytes are 10xxxxxx
    lead_bytes = leads_before[blob_start + byte_len] - leads_before[blob_start]
    rows, flag = _rows_and_flags(table, byte_len, special)
    if int(byte_len.max()) > MAX_TOKEN_BYTES:
        raise ValueError(f"a token of {int(byte_len.max())} bytes is longer than the bridge's tables hold ({MAX_TOKEN_BYTES})")
    record = np.zeros((size, 2), dtype=np.int64)
    record[:, 0] = flag.astype(np.int64) | np.where(valid, 0, INVALID) | byte_len << LEN_SHIFT | blob_start << START_SHIFT
    record.view(np.uint8)[:, INLINE_BYTES:] = rows[:, :INLINE_BYTES]  # the first 8 bytes (of a token that has at most 8)
    profile = VocabProfile(
        token_bytes=tuple(table),
        byte_len=byte_len,
        rows=rows,
        flag=flag,
        lead_bytes=lead_bytes,
        blob=blob,
        blob_start=blob_start,
        record=record,
        inline=record.view(np.uint8),
        valid=valid,
        has_holes=not bool(valid.all()),
        has_empty=bool((valid & ~special & (byte_len == 0)).any()),
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


def _rows_and_flags(table: list[bytes], byte_len: np.ndarray, special: np.ndarray):
    """(V, ROW) padded token bytes and (V,) flag bits; see ROW and the flag bits."""
    rows = np.frombuffer(b"".join(token[:ROW].ljust(ROW, PAD) for token in table), dtype=np.uint8).reshape(-1, ROW)
    starts_char = (byte_len == 0) | ((rows[:, 0] & 0xC0) != 0x80)
    slow = (byte_len > ROW) | np.array([PAD in token for token in table])
    flag = (special * SPECIAL + starts_char * STARTS_CHAR + slow * SLOW).astype(np.uint8)
    return rows.copy(), flag


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
