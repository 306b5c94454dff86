"""The destination encoders a bridge uses: private copies of the destination's Rust tokenizer, tuned
for the one thing the bridge asks of them, token ids of a completion's text.

- Literal special-token text stays text (`encode_special_tokens`), no truncation, no padding.
- No post-processor: without special tokens it only adjusts offsets, which the bridge never reads
  (dropped only when the probe texts confirm the ids do not change).
- Where it is checked to give the destination's ids, tiktoken's encode over the destination's own
  vocabulary stands in for `tokenizers`' (`fastbpe.py` for a byte-level BPE, `fastspm.py` for a
  SentencePiece BPE): about three to four times faster a core on this project's texts.
- A normalizer made only of literal Replace steps, `\\A`-anchored literal Replace steps and Prepend
  (SentencePiece conversions: " " -> U+2581, a leading U+2581 doubled) is applied in Python with
  str.replace, which is what those steps do, and `plain` encodes the result without normalizer: the
  Rust normalizer tracks every character's alignment, a cost (a fifth of Mistral's encode) the ids
  do not depend on. Other normalizers (NFC, ...) stay inside `plain`.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from functools import partial
from typing import Callable

from tokenizers import Tokenizer

from tokenbridge.fastbpe import tiktoken_ids
from tokenbridge.fastspm import sentencepiece_ids
from tokenbridge.profile import PROBE_TEXTS, VocabProfile

CHECK_TEXTS = PROBE_TEXTS + (" x", "  x", "\u2581x", "x \u2581 y", "", "caf\u00e9 na\u00efve \u00c5 \ufb01 \ud55c\uad6d\uc5b4 \u1e69")


@dataclass(frozen=True, eq=False)
class Encoders:
    """`full` encodes any text as the destination does (and gives offsets, for the slow paths);
    `plain(normalize(text))` gives the same ids faster, for every text that `plain_ok` accepts, and
    `fast(text)` (where not None: `fastbpe.py`, `fastspm.py`) faster still, for those texts too."""

    full: Tokenizer
    plain: Tokenizer
    normalize: Callable[[str], str]
    plain_ok: Callable[[str], bool]
    fast: Callable[[str], list[int]] | None = None

    def ids(self, texts: list[str]) -> list[list[int]]:
        """The destination's ids of each text, without special tokens: one batch encode, no offsets."""
        if all(map(self.plain_ok, texts)):
            if self.fast is not None:  # one text after another, at 3-4 times `tokenizers`' speed a core
                return [self.fast(text) for text in texts]
            encodings = self.plain.encode_batch_fast([self.normalize(text) for text in texts], add_special_tokens=False)
        else:
            encodings = self.full.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def ids_one(self, text: str) -> list[int]:
        """`ids` of one text."""
        if self.plain_ok(text):
            if self.fast is not None:
                return self.fast(text)
            return self.plain.encode_batch_fast([self.normalize(text)], add_special_tokens=False)[0].ids
        return self.full.encode_batch_fast([text], add_special_tokens=False)[0].ids


_ENCODERS: dict[str, Encoders] = {}  # fingerprint -> encoders, shared by all bridges to that tokenizer


def encoders_for(backend: Tokenizer, profile: VocabProfile) -> Encoders:
    """The (cached) encoders of a destination backend; the caller's tokenizer object is left untouched."""
    encoders = _ENCODERS.get(profile.fingerprint)
    if encoders is None:
        full, text = _private_copy(backend)
        config = json.loads(text)
        # a SentencePiece BPE's stand-in is checked against `full` itself: with it, no normalizer-less copy
        # (a second parse of the tokenizer: seconds for Gemma 3's 262,144 tokens) is ever used
        fast = sentencepiece_ids(config, profile.token_bytes, full, CHECK_TEXTS)
        plain, normalize, plain_ok = _without_normalizer(full, config, build=fast is None)
        if fast is None:  # tiktoken's encode for a byte-level BPE (whose `normalize` is the identity)
            fast = tiktoken_ids(config, profile.token_bytes, plain, CHECK_TEXTS)
        encoders = _ENCODERS[profile.fingerprint] = Encoders(full, plain, normalize, plain_ok, fast)
    return encoders


def _private_copy(backend: Tokenizer) -> tuple[Tokenizer, str]:
    """A copy to tune, and the backend's tokenizer.json text it was made from."""
    text = backend.to_str()
    encoder = Tokenizer.from_str(text)
    encoder.encode_special_tokens = True
    encoder.no_truncation()
    encoder.no_padding()
    before = _probe_ids(encoder)
    encoder.post_processor = None
    if _probe_ids(encoder) != before:
        encoder.post_processor = backend.post_processor
    return encoder, text


def _without_normalizer(full: Tokenizer, config: dict, build: bool = True
                        ) -> tuple[Tokenizer, Callable[[str], str], Callable[[str], bool]]:
    """(plain, normalize, plain_ok): a copy without the normalizer, what it did in Python, and the texts
    for which that holds; when the probes agree. Else (full, identity, always). config: full's, as a dict.
    Not ``build``: (full, identity, plain_ok), for a caller whose fast encoder reads the raw text."""
    normalizer = config.get("normalizer")
    if normalizer == {"type": "NFC"}:
        normalize, plain_ok = _identity, partial(unicodedata.is_normalized, "NFC")
    else:
        normalize, plain_ok = _literal_normalizer(normalizer), _always
    if normalize is None or normalizer is None:
        return full, _identity, _always
    if not build:
        return full, _identity, plain_ok
    plain = Tokenizer.from_str(json.dumps({**config, "normalizer": None}))
    plain.encode_special_tokens = True
    plain.no_truncation()  # config is the backend's own: its truncation and padding too
    plain.no_padding()
    texts = [text for text in CHECK_TEXTS if plain_ok(text)]
    if _probe_ids(plain, texts, normalize) != _probe_ids(full, texts):
        return full, _identity, _always
    return plain, normalize, plain_ok


def _probe_ids(encoder: Tokenizer, texts=CHECK_TEXTS, normalize: Callable[[str], str] | None = None) -> list[list[int]]:
    texts = [normalize(text) if normalize else text for text in texts]
    return [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]


def _identity(text: str) -> str:
    return text


def _always(text: str) -> bool:
    return True


def _literal_normalizer(normalizer: dict | None) -> Callable[[str], str] | None:
    """The normalizer as a Python function, if every step is a literal replacement; else None."""
    if normalizer is None:
        return _identity
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    steps = [_literal_step(part) for part in parts]
    if any(step is None for step in steps):
        return None

    def normalize(text: str) -> str:
        for step in steps:
            text = step(text)
        return text

    return normalize


def _literal_step(part: dict) -> Callable[[str], str] | None:
    kind, pattern, content = part.get("type"), part.get("pattern", {}), part.get("content", "")
    if kind == "Prepend" and part.get("prepend"):
        prefix = part["prepend"]
        return lambda text: prefix + text if text else text
    if kind != "Replace":
        return None
    if pattern.get("String"):
        old = pattern["String"]
        return lambda text: text.replace(old, content)
    regex = pattern.get("Regex", "")
    literal = regex[2:]
    if regex.startswith("\\A") and literal and all(ch.isalnum() or ch in " \u2581" for ch in literal):
        return lambda text: content + text[len(literal):] if text.startswith(literal) else text
    return None
