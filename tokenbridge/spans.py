"""Span alignment of many completions at once, from per-token byte-length tables (no offsets).

The K completions are laid end to end: one byte space (their texts' UTF-8, back to back), one run
of source tokens and one of destination tokens. A token starts at the cumulative byte length of
the tokens before it, so cuts, group ids, group boundaries, characters and residuals of the whole
batch take a fixed number of numpy calls, whatever K is; only the split into per-completion arrays
loops over K. At these lengths (hundreds of tokens) a numpy call costs about as much as the work
inside it, so the code counts calls: no call that a scalar write or a Python loop over K can replace.

The rules are those of `align.align` (the reference, still used by the slow paths):

- a cut is a byte where a token starts on both sides, at a character start, strictly inside a
  text; groups are the runs between cuts;
- every text's first token opens a group, so no group crosses two completions; so do a
  completion's trailing end tokens (source) and its EOS (destination): the zero-character EOS group;
- a token with no bytes joins the group of the token after it (at a text's end, the one before).

Precondition, checked by the caller: each completion's destination tokens spell exactly its text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.align import Groups, SpanAlignment
from tokenbridge.profile import STARTS_CHAR, VocabProfile, bounds_of


@dataclass(slots=True, eq=False)
class Side:
    """One side of K completions laid end to end; completion k owns tokens firsts[k]:firsts[k+1]."""

    ids: np.ndarray  # (N,) int64
    bounds: np.ndarray  # (N+1,) int64 start byte of each token in the texts, then their total length
    firsts: list[int]  # (K+1,) first token of each completion, then N
    ends: list[int]  # first end token (source) or the EOS (destination) of each completion that has one
    flags: np.ndarray | None  # (N,) uint8 flags of the tokens (see profile.py); None on the destination side
    any_flags: int  # all their flags or-ed


@dataclass(slots=True, eq=False)
class Laid:
    """K non-empty completions end to end, both sides spelling the same texts."""

    src: Side  # end tokens included
    dst: Side  # one EOS per completion with end tokens, last
    raw: bytes  # the K texts' UTF-8, back to back
    byte_firsts: list[int]  # (K+1,) first byte of each text in raw, then len(raw)
    n_chars: list[int]  # (K,) characters of each text
    src_drop: list[int]  # (K,) 1 where a dummy-prefix space was dropped in front of the source text


@dataclass(slots=True, eq=False)
class Piece:
    """One completion's share of a batch alignment; arrays are read-only."""

    dst_ids: np.ndarray  # (n_dst,) int64
    span: SpanAlignment
    n_dst_per_group: np.ndarray  # (G,) float64 destination tokens per group: the divisor of its log-prob sum


def drop_leading(bounds: np.ndarray, firsts: list[int], drop: list[int]) -> None:
    """In place: each completion's dropped leading byte moves every later byte one back. Shifting the
    token ENDS leaves each completion's first token at its text's first byte, as the decoder's strip does."""
    if len(drop) == 1:
        bounds[1:] -= 1
    else:
        bounds[1:] -= np.repeat(np.cumsum(drop), np.diff(firsts))


def align_laid(src: VocabProfile, dst: VocabProfile, laid: Laid) -> list[Piece]:
    """Align every completion of `laid` (see the module doc); one Piece per completion, in order."""
    s, d = laid.src, laid.dst
    assert s.bounds[-1] == d.bounds[-1] == len(laid.raw), "both sides must spell the texts"
    common = _cuts(src, laid)
    src_opens, dst_opens = _opens(common, s, src.has_empty), _opens(common, d, dst.has_empty)
    src_bounds, dst_bounds = src_opens.nonzero()[0], dst_opens.nonzero()[0]
    assert len(src_bounds) == len(dst_bounds), "every cut opens a group on both sides"
    src_group, dst_group = _group_ids(src_opens), _group_ids(dst_opens)
    if laid.raw.isascii():
        chars = s.bounds.take(src_bounds)
    else:  # characters before a cut = UTF-8 lead bytes before it (a cut never splits a character)
        lead = bounds_of(src.lead_bytes.take(s.ids))
        if any(laid.src_drop):
            drop_leading(lead, s.firsts, laid.src_drop)  # a dropped space: one byte, one lead byte
        chars = lead.take(src_bounds)
    n_src_g = src_bounds[1:] - src_bounds[:-1]
    n_dst_g = dst_bounds[1:] - dst_bounds[:-1]
    n_chars_g = chars[1:] - chars[:-1]
    inexact = (n_src_g * n_dst_g) != 1  # counts are >= 1, so a product of 1 means one-to-one
    n_dst_g = n_dst_g.astype(np.float64)  # the divisor of log-prob sums: float, so the division casts nothing
    for array in (d.ids, src_group, dst_group, src_bounds, dst_bounds, chars, n_dst_g):
        array.setflags(write=False)  # shared with the cache; the slices below are read-only views
    if len(laid.n_chars) == 1:
        residual = float(n_chars_g.dot(inexact)) / laid.n_chars[0]
        return [Piece(d.ids, SpanAlignment(src_group, dst_group, Groups(src_bounds, dst_bounds, chars), residual), n_dst_g)]
    n_chars_g[~inexact] = 0
    group_firsts = src_group.take(s.firsts[:-1]).tolist() + [len(n_src_g)]
    inexact_chars = np.add.reduceat(n_chars_g, group_firsts[:-1]).tolist()
    arrays = (src_group, dst_group, src_bounds, dst_bounds, chars, n_dst_g)
    return [_piece(laid, k, group_firsts, inexact_chars[k], arrays) for k in range(len(laid.n_chars))]


def _cuts(src: VocabProfile, laid: Laid) -> np.ndarray:
    """(L+1,) bool: byte p is a cut (a token of each side starts there, at a character start, inside a text)."""
    src_starts, dst_starts = laid.src.bounds[:-1], laid.dst.bounds[:-1]
    marks = np.zeros(len(laid.raw) + 1, dtype=np.uint8)
    if laid.raw.isascii():
        marks[src_starts] = STARTS_CHAR
    elif not src.has_empty:  # the source token starting at p tells whether byte p starts a character
        marks[src_starts] = laid.src.flags & STARTS_CHAR
    else:  # a token with no bytes knows nothing about the byte after it: read the text itself
        marks[src_starts] = STARTS_CHAR
        marks[:-1] *= (np.frombuffer(laid.raw, dtype=np.uint8) & 0xC0) != 0x80  # not 10xxxxxx
    marks[dst_starts] = marks.take(dst_starts) + 1  # read all, then write: a repeated start adds once
    common = marks == STARTS_CHAR + 1
    for p in laid.byte_firsts:  # texts' first bytes and the end: never cuts (first tokens are forced open)
        common[p] = False
    return common


def _opens(common: np.ndarray, side: Side, has_empty: bool) -> np.ndarray:
    """(N+1,) bool: token i opens a group (its start is a cut, or it is forced open); True at N."""
    opens = common.take(side.bounds)
    if has_empty:  # tokens sharing a start byte: only the first of them may open the group there
        opens[1:-1] &= side.bounds[1:-1] != side.bounds[:-2]
    for i in side.firsts:  # each completion's first token, and N
        opens[i] = True
    for i in side.ends:
        opens[i] = True
    return opens


def _group_ids(opens: np.ndarray) -> np.ndarray:
    """(N,) int64 group of each token: the opening tokens after the first, up to it."""
    opens[0] = False  # token 0 opens group 0: leave it out of the count instead of subtracting 1
    ids = opens[:-1].cumsum()
    opens[0] = True
    return ids


def _piece(laid: Laid, k: int, group_firsts: list[int], inexact_chars: int, arrays: tuple) -> Piece:
    """Completion k's slices of the batch arrays, renumbered from 0."""
    src_group, dst_group, src_bounds, dst_bounds, chars, n_dst_g = arrays
    s0, s1 = laid.src.firsts[k], laid.src.firsts[k + 1]
    d0, d1 = laid.dst.firsts[k], laid.dst.firsts[k + 1]
    g0, g1 = group_firsts[k], group_firsts[k + 1]
    own = [src_group[s0:s1] - g0, dst_group[d0:d1] - g0, src_bounds[g0 : g1 + 1] - s0,
           dst_bounds[g0 : g1 + 1] - d0, chars[g0 : g1 + 1] - chars[g0]]
    for array in own:
        array.setflags(write=False)
    span = SpanAlignment(own[0], own[1], Groups(own[2], own[3], own[4]), inexact_chars / laid.n_chars[k])
    return Piece(laid.dst.ids[d0:d1], span, n_dst_g[g0:g1])
