"""The slow paths of a bridge, one completion at a time, for texts the fast path cannot take.

The fast path (`fastspell.py`, `fastalign.py`) needs the destination's token bytes to spell the text. When they
do not:

- the destination normalises to one Unicode form (Qwen2: NFC) and the text is not in that form:
  map the separable positions into the normalised text and align there (`_align_normalized`);
- the destination's decode is its tokens' bytes and it does not normalise (byte-level BPE): its tokens
  drop a byte its vocabulary lacks, so the text cannot cross (`AlignmentError`, never a silent misalignment);
- otherwise (a tokenizer whose decode is not its token bytes, the SentencePiece marker U+2581 inside the
  text, ...): encode again with character offsets into the original text and align by those
  (`_align_by_offsets`).
"""

from __future__ import annotations

import unicodedata

import numpy as np
from tokenizers import Encoding, Tokenizer

from tokenbridge.align import (
    Groups,
    SpanAlignment,
    align,
    align_normalized,
    char_start_mask,
    offset_starts,
)
from tokenbridge.errors import AlignmentError
from tokenbridge.profile import VocabProfile


def slow_span(
    dst: VocabProfile, encoder: Tokenizer, raw: bytes, text: str, src_starts: np.ndarray, dst_ids: np.ndarray
) -> SpanAlignment:
    """Align one completion's body (source starts in `raw`'s bytes) with destination ids that do not spell it."""
    char_starts = char_start_mask(raw)
    if dst.exact and not dst.unicode_form and not dst.strips_leading_space:  # its tokens are the text's bytes
        raise AlignmentError(_unspelled(raw, dst.gather(dst_ids)[0]))
    if dst.exact and dst.unicode_form and not dst.strips_leading_space:
        dst_raw, dst_starts = dst.gather(dst_ids)
        return _align_normalized(dst.unicode_form, raw, dst_raw, src_starts, dst_starts, char_starts)
    encoding = encoder.encode(text, add_special_tokens=False)
    return _align_by_offsets(encoding, src_starts, raw, char_starts, dst.composes)


def _unspelled(raw: bytes, dst_raw: bytes) -> str:
    """Why a destination whose decode is its tokens' bytes, unnormalised, did not spell the text: its
    vocabulary lacks a byte the text holds (SmolLM2's has no token for 0x16, nor for 0xF1, a 4-byte lead)."""
    at = next((i for i, (a, b) in enumerate(zip(raw, dst_raw)) if a != b), min(len(raw), len(dst_raw)))
    char = raw[:at].decode("utf-8", "ignore")
    whole = raw.decode("utf-8")
    missing = whole[len(char)] if len(char) < len(whole) else ""
    what = f"U+{ord(missing):04X} (character {len(char)} of {len(whole)})" if missing else "the text's end"
    return f"the destination's vocabulary cannot spell {what}: its tokens drop it; the completion cannot cross"


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


def with_eos(span: SpanAlignment, dst_ids: np.ndarray, n_end: int, dst_eos_id: int) -> tuple[SpanAlignment, np.ndarray]:
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
