"""Compiled alignment of the fast path: both sides' token start bytes (`fastspell.py`) grouped by the
rules below (`align`, and its one-completion and batch forms `align_one`, `align_batch`), and a source
log-prob per token spread over the destination tokens of its group (`spread`).

The rules (those of `align.align`, the reference the slow paths still use):

- a cut is a byte where a token of each side starts, at a character start, strictly inside a text;
  groups are the runs between cuts;
- every text's first token opens a group, so no group crosses two completions; so do a completion's
  trailing end tokens (source) and its EOS (destination): the zero-character EOS group;
- a token with no bytes joins the group of the token after it (at a text's end, the one before).

K completions are laid end to end, as in `fastspell.py`: completion k owns source tokens
src_firsts[k]:src_firsts[k+1], destination tokens dst_firsts[k]:dst_firsts[k+1], and bytes
byte_firsts[k]:byte_firsts[k+1] of `raw`.
"""

from __future__ import annotations

import numpy as np

from tokenbridge.fastspell import CONTINUATION, CONTINUATION_MASK, dst_side
from tokenbridge.jit import njit


@njit(cache=True, nogil=True)
def _opens(mark, raw, bounds, forced):
    """(N+1,) bool: token i opens a group (its start is a cut no earlier token starts at, or forced)."""
    n = bounds.size - 1
    opens = np.zeros(n + 1, np.bool_)
    for i in range(n + 1):
        p = bounds[i]
        if mark[p] == 2 and (raw[p] & CONTINUATION_MASK) != CONTINUATION and (i == 0 or p != bounds[i - 1]):
            opens[i] = True
    for x in range(forced.size):
        opens[forced[x]] = True
    return opens


@njit(cache=True, nogil=True)
def _groups(opens):
    """(group of each token (N,), the opening tokens (G+1,), N last)."""
    n = opens.size - 1
    count = 0
    for i in range(n + 1):
        count += opens[i]
    group = np.empty(n, np.int64)
    at = np.empty(count, np.int64)
    g = -1
    for i in range(n + 1):
        if opens[i]:
            g += 1
            at[g] = i
        if i < n:
            group[i] = g
    return group, at


@njit(cache=True, nogil=True)
def _align(raw, byte_firsts, src_bounds, src_forced, dst_bounds, dst_forced, src_firsts):
    """The module's rules: a cut is a byte where a token of each side starts, at a character
    start, that is no text's first byte nor the end. Returns (ok, src_group, dst_group, src_at, dst_at,
    chars, n_dst, inexact): chars (G+1,) characters before each group, n_dst (G,) float64 destination
    tokens per group, inexact (K,) characters of each completion in groups that are not one-to-one; ok
    is False if the sides open different numbers of groups."""
    mark = np.zeros(raw.size + 1, np.uint8)
    for i in range(src_bounds.size - 1):
        mark[src_bounds[i]] = 1
    for j in range(dst_bounds.size - 1):
        p = dst_bounds[j]
        if mark[p] == 1:
            mark[p] = 2
    for k in range(byte_firsts.size):
        mark[byte_firsts[k]] = 0
    src_group, src_at = _groups(_opens(mark, raw, src_bounds, src_forced))
    dst_group, dst_at = _groups(_opens(mark, raw, dst_bounds, dst_forced))
    if dst_at.size != src_at.size:
        return False, src_group, dst_group, src_at, dst_at, np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64)
    g_count = src_at.size - 1
    chars = np.empty(g_count + 1, np.int64)
    count = 0
    q = 0
    for g in range(g_count + 1):  # characters before a cut = UTF-8 lead bytes before it
        p = src_bounds[src_at[g]]
        while q < p:
            count += (raw[q] & CONTINUATION_MASK) != CONTINUATION
            q += 1
        chars[g] = count
    n_dst = np.empty(g_count)
    inexact = np.zeros(src_firsts.size - 1, np.int64)
    k = 0
    for g in range(g_count):
        while src_at[g] >= src_firsts[k + 1]:
            k += 1
        d = dst_at[g + 1] - dst_at[g]
        n_dst[g] = d
        if (src_at[g + 1] - src_at[g]) * d != 1:
            inexact[k] += chars[g + 1] - chars[g]
    return True, src_group, dst_group, src_at, dst_at, chars, n_dst, inexact


@njit(cache=True, nogil=True)
def align(dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts,
          src_bounds, src_firsts):
    """Everything after the destination encode: its ids (dst_ids (M,) uint32, the K encodings back to
    back) laid out with an EOS per completion that had n_end > 0 end tokens, checked to spell the texts,
    and aligned with the source. Returns (shift (K,), dst_ids, dst_firsts, ok, src_group, dst_group,
    src_at, dst_at, chars, n_dst, inexact); nothing is aligned (ok False) unless every shift is >= 0."""
    ids, dst_bounds, dst_firsts, shift, dst_forced = dst_side(
        dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts
    )
    for k in range(shift.size):
        if shift[k] < 0:
            return (shift, ids, dst_firsts, False, np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64),
                    np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64))
    k_count = n_end.size
    n_forced = k_count + 1
    for k in range(k_count):
        n_forced += n_end[k] > 0
    src_forced = np.empty(n_forced, np.int64)
    f = 0
    for k in range(k_count):
        src_forced[f] = src_firsts[k]
        f += 1
        if n_end[k]:
            src_forced[f] = src_firsts[k + 1] - n_end[k]
            f += 1
    src_forced[f] = src_firsts[k_count]
    result = _align(raw, byte_firsts, src_bounds, src_forced, dst_bounds, dst_forced, src_firsts)
    return (shift, ids, dst_firsts) + result


@njit(cache=True, nogil=True)
def align_one(dst_ids, n_end, eos_id, record, inline, blob, strips_leading_space, raw, src_bounds):
    """`align` of one completion (raw: its bytes, src_bounds: `spell_one`'s), packed into two arrays for the
    same reason as `spell_one`: (shift, ok, inexact, m, g_count, ints, n_dst) with ints (2m + n + 3(G+1),)
    = dst_ids (m) | dst_group (m) | src_group (n) | src_at | dst_at | chars (G+1 each), n_dst (G,) float64;
    both empty unless shift >= 0 and ok."""
    dst_firsts = np.empty(2, np.int64)
    dst_firsts[0] = 0
    dst_firsts[1] = len(dst_ids)
    ends = np.empty(1, np.int64)
    ends[0] = n_end
    src_firsts = np.empty(2, np.int64)
    src_firsts[0] = 0
    src_firsts[1] = src_bounds.size - 1
    byte_firsts = np.empty(2, np.int64)
    byte_firsts[0] = 0
    byte_firsts[1] = raw.size
    shift, ids, _, ok, src_group, dst_group, src_at, dst_at, chars, n_dst, inexact = align(
        dst_ids, dst_firsts, ends, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts, src_bounds,
        src_firsts,
    )
    if shift[0] < 0 or not ok:
        return shift[0], ok, 0, 0, 0, np.empty(0, np.int64), np.empty(0)
    m, n, g1 = ids.size, src_group.size, src_at.size
    ints = np.empty(2 * m + n + 3 * g1, np.int64)
    at = 0
    for part in (ids, dst_group, src_group, src_at, dst_at, chars):
        ints[at : at + part.size] = part
        at += part.size
    return shift[0], ok, inexact[0], m, g1 - 1, ints, n_dst


@njit(cache=True, nogil=True)
def spread(src_group, dst_group, n_dst, logprobs):
    """Each group's log-prob sum (float64, in token order, as np.bincount adds) spread uniformly over its
    destination tokens. Returns (bad, dst_logprobs, all_true): bad is the first group whose sum is not
    finite, else -1 (dst_logprobs is then empty); all_true: (M,) True, the loss mask when none was given
    (one call less on the path that matters, the engine's)."""
    g_count = n_dst.size
    sums = np.zeros(g_count)
    for i in range(logprobs.size):
        sums[src_group[i]] += logprobs[i]
    for g in range(g_count):
        if not np.isfinite(sums[g]):
            return g, np.empty(0), np.empty(0, np.bool_)
    out = np.empty(dst_group.size)
    for j in range(dst_group.size):
        g = dst_group[j]
        out[j] = sums[g] / n_dst[g]
    return -1, out, np.ones(dst_group.size, np.bool_)  # and the loss mask when none was given


@njit(cache=True, nogil=True)
def align_batch(dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts,
                src_bounds, src_firsts):
    """`align` of K completions, its results renumbered per completion: (shift, dst_ids, dst_firsts, ok,
    src_group, dst_group, group_firsts (K+1,), src_at, dst_at, chars, n_dst, inexact). Group and token
    numbers count from each completion's first; completion k's groups are n_dst[g0:g1] and its (G_k+1,)
    boundaries src_at / dst_at / chars[g0 + k : g1 + k + 1], with g0, g1 = group_firsts[k], group_firsts[k+1]."""
    shift, ids, dst_firsts, ok, src_group, dst_group, src_at, dst_at, chars, n_dst, inexact = align(
        dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts,
        src_bounds, src_firsts,
    )
    k_count = n_end.size
    group_firsts = np.empty(k_count + 1, np.int64)
    if not ok:
        return shift, ids, dst_firsts, ok, src_group, dst_group, group_firsts, src_at, dst_at, chars, n_dst, inexact
    g_count = n_dst.size
    for k in range(k_count):
        group_firsts[k] = src_group[src_firsts[k]]
    group_firsts[k_count] = g_count
    own_src_at = np.empty(g_count + k_count, np.int64)
    own_dst_at = np.empty(g_count + k_count, np.int64)
    own_chars = np.empty(g_count + k_count, np.int64)
    for k in range(k_count):
        g0, g1 = group_firsts[k], group_firsts[k + 1]
        for i in range(src_firsts[k], src_firsts[k + 1]):
            src_group[i] -= g0
        for j in range(dst_firsts[k], dst_firsts[k + 1]):
            dst_group[j] -= g0
        for g in range(g0, g1 + 1):
            own_src_at[g + k] = src_at[g] - src_firsts[k]
            own_dst_at[g + k] = dst_at[g] - dst_firsts[k]
            own_chars[g + k] = chars[g] - chars[g0]
    return (shift, ids, dst_firsts, ok, src_group, dst_group, group_firsts, own_src_at, own_dst_at, own_chars, n_dst,
            inexact)
