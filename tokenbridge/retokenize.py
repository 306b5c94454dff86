"""Source ids -> text -> destination ids, aligned: the log-prob independent (cacheable) part of a bridge.

- A trailing run of end tokens (EOS, `<|im_end|>`, `</s>`, ...) maps to ONE destination EOS in its own
  zero-character group; any other special token raises `SpecialTokenError`.
- The text is the concatenation of the source tokens' bytes (SentencePiece's dummy-prefix space
  stripped, as its decoder does); invalid UTF-8 raises `UndecodableTextError`.
- Destination ids are the destination's own encoding of the text without special tokens, with
  literal special-token strings kept as text (`encode_special_tokens`), no truncation, no padding.
- Fast path: when the destination's token bytes spell the text exactly (after at most SentencePiece's
  one dummy-prefix space), boundaries are cumulative byte lengths and the encode skips offset
  tracking. Otherwise (a normalizer changed characters, e.g. Qwen2's NFC) the text is encoded again
  with offsets into the original text, which stay exact.
"""

from __future__ import annotations

import unicodedata
from array import array
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding, Tokenizer

from tokenbridge.align import (
    Groups,
    SpanAlignment,
    align,
    align_normalized,
    char_start_mask,
    chars_before,
    offset_starts,
)
from tokenbridge.errors import AlignmentError, EmptyCompletionError, SpecialTokenError, UndecodableTextError
from tokenbridge.profile import VocabProfile


@dataclass(frozen=True, eq=False)
class Aligned:
    """A completion in destination tokens, without log-probs or masks; arrays are read-only."""

    text: str
    dst_ids: np.ndarray  # (n_dst,) int64
    span: SpanAlignment
    n_dst_per_group: np.ndarray  # (G,) float64, the divisor that spreads a group's log-prob sum
    eos: bool


_ENCODERS: dict[str, Tokenizer] = {}  # fingerprint -> private encoder, shared by all bridges to that tokenizer


def private_encoder(backend: Tokenizer, profile: VocabProfile) -> Tokenizer:
    """A copy of a destination backend that keeps literal special-token text as text and never truncates
    or pads; the caller's tokenizer object is left untouched."""
    encoder = _ENCODERS.get(profile.fingerprint)
    if encoder is None:
        encoder = Tokenizer.from_str(backend.to_str())
        encoder.encode_special_tokens = True
        encoder.no_truncation()
        encoder.no_padding()
        _ENCODERS[profile.fingerprint] = encoder
    return encoder


def _frozen(aligned: Aligned) -> Aligned:
    span = aligned.span
    groups = span.groups
    for array_ in (aligned.dst_ids, span.src_group, span.dst_group, groups.src, groups.dst, groups.chars):
        array_.flags.writeable = False
    return aligned


def _int64(values: list[int]) -> np.ndarray:
    return np.frombuffer(array("q", values), dtype=np.int64)  # ~2x faster than np.array(list)


def _stripped(profile: VocabProfile, raw: bytes, starts: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Drop SentencePiece's dummy-prefix space, as its decoder does, shifting token starts (clipped at 0)."""
    if profile.strips_leading_space and raw.startswith(b" "):
        raw = raw[1:]
        starts -= 1
        np.maximum(starts, 0, out=starts)
    return raw, starts


def identity(profile: VocabProfile, ids: np.ndarray) -> Aligned:
    """Same tokenizer: every token is its own one-to-one group, ids (specials included) pass through."""
    raw, starts = _stripped(profile, *profile.gather(ids))
    bounds = np.arange(len(ids) + 1, dtype=np.int64)
    chars = chars_before(np.append(starts, len(raw)), char_start_mask(raw))  # counted by UTF-8 lead bytes
    span = SpanAlignment(bounds[:-1], bounds[:-1].copy(), Groups(bounds, bounds.copy(), chars), 0.0)
    text = raw.decode("utf-8", errors="replace")
    return _frozen(Aligned(text, ids.copy(), span, np.ones(len(ids)), bool(int(ids[-1]) in profile.end_ids)))


def split_eos(profile: VocabProfile, ids: np.ndarray, dst_eos_id: int | None) -> tuple[np.ndarray, int]:
    """Body ids and the number of trailing end tokens; raises on any other special token."""
    special = profile.special[ids]
    if not special.any():
        return ids, 0
    n_end = 0
    while n_end < len(ids) and int(ids[len(ids) - 1 - n_end]) in profile.end_ids:
        n_end += 1
    body = ids[: len(ids) - n_end]
    if special[: len(body)].any():
        pos = int(np.argmax(special[: len(body)]))
        raise SpecialTokenError(
            f"src_ids[{pos}] = {int(ids[pos])} is a special token inside the completion; only trailing end"
            " tokens (EOS) can cross the bridge"
        )
    if dst_eos_id is None:
        raise SpecialTokenError(
            "the completion ends with EOS but the destination tokenizer has no EOS token; pass Bridge(dst_eos_id=...)"
        )
    return body, n_end


def source_text(profile: VocabProfile, body: np.ndarray) -> tuple[bytes, str, np.ndarray]:
    """(UTF-8 bytes, text, (n,) start byte of each token) of the completion body."""
    raw, starts = _stripped(profile, *profile.gather(body))
    try:
        return raw, raw.decode("utf-8"), starts
    except UnicodeDecodeError as exc:
        raise UndecodableTextError(
            f"source ids decode to invalid UTF-8 at byte {exc.start} of {len(raw)} (completion cut inside a character?)"
        ) from None


def retokenize(
    src: VocabProfile, dst: VocabProfile, encoder: Tokenizer, ids: np.ndarray, dst_eos_id: int | None
) -> Aligned:
    """Align source ids (validated, non-empty) onto the destination's encoding of their text."""
    body, n_end = split_eos(src, ids, dst_eos_id)
    raw, text, src_starts = source_text(src, body)
    if not raw:
        if not n_end:
            raise EmptyCompletionError("src_ids decode to empty text and carry no EOS: there is nothing to bridge")
        return _eos_only(len(ids), dst_eos_id)
    ids_list = encoder.encode_batch_fast([text], add_special_tokens=False)[0].ids
    if not ids_list:
        raise AlignmentError(f"the destination tokenizer encodes the {len(text)}-character completion as no tokens")
    dst_ids = _int64(ids_list)
    char_starts = char_start_mask(raw)
    dst_raw, dst_starts = dst.gather(dst_ids)
    shift = len(dst_raw) - len(raw)
    dummy_prefix = shift == 1 and dst.strips_leading_space and dst_raw[:1] == b" "
    if dst.exact and (shift == 0 or dummy_prefix) and dst_raw.endswith(raw):
        if shift:
            dst_starts -= 1
            np.maximum(dst_starts, 0, out=dst_starts)
        span = align(src_starts, dst_starts, None, len(raw), char_starts)
    elif dst.exact and dst.unicode_form and not dst.strips_leading_space:
        span = _align_normalized(dst.unicode_form, raw, dst_raw, src_starts, dst_starts, char_starts)
    else:
        encoding = encoder.encode(text, add_special_tokens=False)
        span = _align_by_offsets(encoding, src_starts, raw, char_starts, dst.composes)
    if n_end:
        span, dst_ids = _with_eos(span, dst_ids, n_end, dst_eos_id)
    return _frozen(Aligned(text, dst_ids, span, np.diff(span.groups.dst).astype(np.float64), bool(n_end)))


def _separable_positions(raw: bytes) -> np.ndarray:
    """Byte positions where any Unicode normalisation splits: the ends, and before every ASCII character
    (ASCII has combining class 0 and is never the second half of a composition)."""
    mask = np.empty(len(raw) + 1, dtype=bool)
    np.less(np.frombuffer(raw, dtype=np.uint8), 0x80, out=mask[:-1])
    mask[0] = mask[-1] = True
    return np.flatnonzero(mask)


def _align_normalized(
    form: str, raw: bytes, dst_raw: bytes, src_starts: np.ndarray, dst_starts: np.ndarray, char_starts
) -> SpanAlignment:
    """The destination tokenized unicodedata.normalize(form, text): map separable positions into the
    normalised text (normalising only the non-ASCII runs), check it is byte-identical, then align."""
    safe = _separable_positions(raw)
    seg_len = np.diff(safe)
    norm_len = seg_len.copy()
    pieces, last = [], 0
    for k in np.flatnonzero(seg_len > 1).tolist():  # segments holding non-ASCII bytes (one ASCII byte otherwise)
        a, b = int(safe[k]), int(safe[k + 1])
        piece = unicodedata.normalize(form, raw[a:b].decode("utf-8")).encode("utf-8")
        pieces += [raw[last:a], piece]
        norm_len[k], last = len(piece), b
    pieces.append(raw[last:])
    if b"".join(pieces) != dst_raw:
        raise AlignmentError(f"the destination's tokens do not spell the {form}-normalised completion; cannot align")
    safe_norm = np.zeros(len(safe), dtype=np.int64)
    np.cumsum(norm_len, out=safe_norm[1:])
    return align_normalized(src_starts, dst_starts, safe, safe_norm, len(dst_raw), char_starts)


def _align_by_offsets(encoding: Encoding, src_starts, raw: bytes, char_starts, composes: bool) -> SpanAlignment:
    """Last resort: the destination's own character offsets. A normaliser that composes or reorders
    characters can blur them, so then only separable positions may be cuts."""
    offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    dst_starts, dst_cut = offset_starts(offsets, char_starts, len(raw))
    if composes:
        separable = np.zeros(len(raw) + 1, dtype=bool)
        separable[_separable_positions(raw)] = True
        dst_cut &= separable[dst_starts]
    return align(src_starts, dst_starts, dst_cut, len(raw), char_starts)


def _with_eos(
    span: SpanAlignment, dst_ids: np.ndarray, n_end: int, dst_eos_id: int
) -> tuple[SpanAlignment, np.ndarray]:
    """Append the EOS group: n_end source end tokens -> one destination EOS, zero characters."""
    g, groups = len(span.groups), span.groups
    eos_groups = Groups(
        src=np.append(groups.src, groups.src[-1] + n_end),
        dst=np.append(groups.dst, groups.dst[-1] + 1),
        chars=np.append(groups.chars, groups.chars[-1]),
    )
    src_group = np.concatenate([span.src_group, np.full(n_end, g, dtype=np.int64)])
    eos_span = SpanAlignment(src_group, np.append(span.dst_group, g), eos_groups, span.residual)
    return eos_span, np.append(dst_ids, np.int64(dst_eos_id))


def _eos_only(n_src: int, dst_eos_id: int) -> Aligned:
    """A completion that is only end tokens (or decodes to nothing before them): one group, one EOS."""
    groups = Groups(src=np.array([0, n_src]), dst=np.array([0, 1]), chars=np.array([0, 0]))
    span = SpanAlignment(np.zeros(n_src, np.int64), np.zeros(1, np.int64), groups, 0.0)
    return _frozen(Aligned("", np.array([dst_eos_id], dtype=np.int64), span, np.ones(1), True))
