"""Span alignment: two token sequences over the same UTF-8 text -> aligned groups and residual.

Everything is in byte positions of the text's UTF-8 encoding (length L). Each side gives, per
token, the byte where it starts and whether a clean cut exists right before it (no token of that
side straddles the position). A group boundary is a position that is a clean cut on both sides
and falls between characters; groups are the runs between consecutive boundaries, so they cover
both sequences exactly and in order. Every boundary is the start of a token on both sides, so no
group is empty on either side. All work is numpy over (n,) and (L+1,) arrays: linear in length,
no per-character Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.errors import AlignmentError

EMPTY_SIDE = "a character span has tokens on one side only; the two tokenizations do not cover the same text"


@dataclass(frozen=True, eq=False)
class Groups:
    """Aligned groups as boundary arrays: group g is src tokens src[g]:src[g+1], dst tokens dst[g]:dst[g+1],
    characters chars[g]:chars[g+1] of the text. All (G+1,) int64, starting at 0, non-decreasing."""

    src: np.ndarray
    dst: np.ndarray
    chars: np.ndarray

    def __len__(self) -> int:
        return len(self.src) - 1

    def one_to_one(self) -> np.ndarray:
        """(G,) bool: the group holds exactly one source and one destination token."""
        return (np.diff(self.src) == 1) & (np.diff(self.dst) == 1)


@dataclass(frozen=True, eq=False)
class SpanAlignment:
    """Result of `align`: per-token group ids, group boundaries and the residual."""

    src_group: np.ndarray  # (n_src,) int64 group of each source token
    dst_group: np.ndarray  # (n_dst,) int64 group of each destination token
    groups: Groups
    residual: float  # fraction of characters in groups that are not one-to-one


def char_start_mask(raw: bytes) -> np.ndarray | None:
    """(L+1,) bool: byte positions where a character starts (and the end); None for ASCII (every byte)."""
    if raw.isascii():
        return None
    codes = np.frombuffer(raw, dtype=np.uint8)
    mask = np.empty(len(raw) + 1, dtype=bool)
    np.not_equal(codes & 0xC0, 0x80, out=mask[:-1])  # continuation bytes are 10xxxxxx
    mask[-1] = True
    return mask


def chars_before(positions: np.ndarray, char_starts: np.ndarray | None) -> np.ndarray:
    """Number of characters that start before each byte position (the character index at a boundary)."""
    if char_starts is None:
        return positions
    return (np.cumsum(char_starts) - char_starts)[positions]


def offset_starts(offsets: np.ndarray, char_starts: np.ndarray | None, n_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts (bytes) and clean-cut flags from tokenizer character offsets (n, 2) into the text, which may
    overlap (several byte tokens of one character) or leave gaps (trimmed whitespace: the gap joins the
    token before it, a leading gap the first token)."""
    byte_of_char = np.arange(n_bytes + 1, dtype=np.int64) if char_starts is None else np.flatnonzero(char_starts)
    starts = np.maximum.accumulate(byte_of_char[offsets[:, 0]])
    ends = np.maximum.accumulate(byte_of_char[offsets[:, 1]])
    starts[0] = 0
    cut = np.ones(len(starts), dtype=bool)
    cut[1:] = ends[:-1] <= starts[1:]
    return starts, cut


def align(
    src_starts: np.ndarray,
    dst_starts: np.ndarray,
    dst_cut: np.ndarray | None,
    n_bytes: int,
    char_starts: np.ndarray | None,
) -> SpanAlignment:
    """Align a gap-free source sequence (src_starts[0] == 0) with a destination sequence over n_bytes > 0 bytes.

    dst_cut: (n_dst,) clean-cut flags, or None when the destination is gap-free too (dst_starts[0] == 0).
    char_starts: `char_start_mask` of the text (None for ASCII).
    """
    marks = np.zeros(n_bytes + 1, dtype=np.uint8)
    marks[src_starts] = 1
    marks[dst_starts if dst_cut is None else dst_starts[dst_cut]] += 2  # repeated indices add once: fine
    common = marks == 3
    if char_starts is not None:
        common &= char_starts
    common[0] = True
    common[n_bytes] = False  # the end closes the last group; tokens of zero length there join it
    group_at = np.cumsum(common)  # (L+1,) 1 + index of the group each byte belongs to
    src_group = group_at[src_starts]
    src_group -= 1
    dst_group = group_at[dst_starts]
    dst_group -= 1
    n_groups = int(group_at[n_bytes])
    n_src = np.bincount(src_group, minlength=n_groups)
    n_dst = np.bincount(dst_group, minlength=n_groups)
    if dst_cut is not None and n_dst.min() == 0:  # gap-free sides cannot leave a group empty; offsets could
        raise AlignmentError(EMPTY_SIDE)
    cuts = np.flatnonzero(common)
    cuts = np.append(cuts, n_bytes)
    if char_starts is None:
        chars = cuts
    else:  # every cut starts a character, so the characters before it are the inclusive count minus one
        chars = np.cumsum(char_starts)[cuts]
        chars -= 1
    groups = Groups(_bounds(n_src), _bounds(n_dst), chars)
    return SpanAlignment(src_group, dst_group, groups, _residual(n_src, n_dst, chars))


def _residual(n_src: np.ndarray, n_dst: np.ndarray, chars: np.ndarray) -> float:
    """Fraction of characters in groups that are not one-to-one (counts are >= 1, so a product of 1 means 1:1)."""
    inexact = (n_src * n_dst) != 1
    return float(np.diff(chars) @ inexact) / float(chars[-1])


def _bounds(counts: np.ndarray) -> np.ndarray:
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return bounds


def align_normalized(
    src_starts: np.ndarray,
    dst_starts: np.ndarray,
    safe_orig: np.ndarray,
    safe_norm: np.ndarray,
    n_norm_bytes: int,
    char_starts: np.ndarray | None,
) -> SpanAlignment:
    """Align when the destination tokenized a normalised copy of the text (e.g. NFC).

    safe_orig / safe_norm: (K,) matching byte positions in the original and the normalised text where
    normalisation is separable (0 and both ends included); dst_starts are in normalised bytes. Only
    safe positions can be group boundaries, so a character the normaliser composed or reordered is
    never split.
    """
    n_bytes = int(safe_orig[-1])
    src_mark = np.zeros(n_bytes + 1, dtype=bool)
    src_mark[src_starts] = True
    dst_mark = np.zeros(n_norm_bytes + 1, dtype=bool)
    dst_mark[dst_starts] = True
    keep = src_mark[safe_orig] & dst_mark[safe_norm]
    keep[0], keep[-1] = True, False
    cuts_orig, cuts_norm = safe_orig[keep], safe_norm[keep]
    n_groups = len(cuts_orig)
    src_group = np.searchsorted(cuts_orig, src_starts, side="right") - 1
    dst_group = np.searchsorted(cuts_norm, dst_starts, side="right") - 1
    n_src = np.bincount(src_group, minlength=n_groups)
    n_dst = np.bincount(dst_group, minlength=n_groups)
    if n_src.min() == 0 or n_dst.min() == 0:
        raise AlignmentError(EMPTY_SIDE)
    chars = chars_before(np.append(cuts_orig, n_bytes), char_starts)
    groups = Groups(_bounds(n_src), _bounds(n_dst), chars)
    return SpanAlignment(src_group, dst_group, groups, _residual(n_src, n_dst, chars))
