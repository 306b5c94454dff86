"""Compiled loops of the fast path: spelling ids from the byte tables, checking that the destination's
tokens spell the text, aligning both sides, spreading log-probs.

Why compiled: right after a Rust encode, every distinct numpy call runs with cold caches (measured on
this project's 2-core machine: a 600-element cumsum takes 20 us instead of 5, a take 10 us instead of
1), so an alignment made of some forty small numpy calls cost several times the work inside it. Here
the work before the encode is one call and the work after it one more (numba, compiled once and
cached on disk), and each token costs one lookup in a packed record table (`VocabProfile.record`: 16
bytes per id holding its flags, byte length, start in the byte blob, and its bytes if it has at most 8).

The rules (those of `align.align`, the reference the slow paths still use):

- a cut is a byte where a token of each side starts, at a character start, strictly inside a text;
  groups are the runs between cuts;
- every text's first token opens a group, so no group crosses two completions; so do a completion's
  trailing end tokens (source) and its EOS (destination): the zero-character EOS group;
- a token with no bytes joins the group of the token after it (at a text's end, the one before).

K completions are laid end to end: completion k owns source tokens src_firsts[k]:src_firsts[k+1],
destination tokens dst_firsts[k]:dst_firsts[k+1], and bytes byte_firsts[k]:byte_firsts[k+1] of `raw`
(the UTF-8 of its text, a dropped dummy-prefix space left out).
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # the GPU check's offline wheelhouse leaves numba out (llvmlite alone is 58 MB): the same
    def njit(*args, **kwargs):  # loops then run as plain Python, slower and alike (NUMBA_DISABLE_JIT=1 tests that)
        return args[0] if args and callable(args[0]) else (lambda fn: fn)

# Record layout (see profile.py): record[t, 0] bits 0-7 flags, 8-23 byte length, 24-63 start in the blob;
# record[t, 1] (seen through `inline`, the same memory as (V, 16) bytes) the token's bytes if it has at most 8.
FLAG_MASK, LEN_SHIFT, LEN_MASK, START_SHIFT = 0xFF, 8, 0xFFFF, 24
INLINE_AT, INLINE_BYTES = 8, 8
INVALID = 8  # profile.INVALID: an id that is not in the vocabulary
SPACE, CONTINUATION_MASK, CONTINUATION = 32, 0xC0, 0x80


@njit(cache=True, nogil=True)
def spell(ids, src_firsts, record, inline, blob, strips_leading_space):
    """The K completions' text bytes and where each token starts in them.

    Returns (bad, any_flags, raw (L,) uint8, bounds (N+1,) int64, byte_firsts (K+1,) int64, drop (K,)
    int64): bad is the position of the first id outside the vocabulary, else -1 (and nothing else is
    filled in). Where `strips_leading_space` (the decoder's dummy-prefix strip), a completion whose bytes
    start with a space drops it: its first token keeps the text's first byte, every later token starts
    one byte earlier.
    """
    n = ids.size
    size = record.shape[0]
    total = 0
    any_flags = 0
    for i in range(n):
        t = ids[i]
        if t < 0 or t >= size:
            return i, 0, np.empty(0, np.uint8), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        r = record[t, 0]
        if r & INVALID:
            return i, 0, np.empty(0, np.uint8), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        total += (r >> LEN_SHIFT) & LEN_MASK
        any_flags |= r & FLAG_MASK
    k_count = src_firsts.size - 1
    raw = np.empty(total, np.uint8)
    bounds = np.empty(n + 1, np.int64)
    byte_firsts = np.empty(k_count + 1, np.int64)
    drop = np.zeros(k_count, np.int64)
    at = 0
    for k in range(k_count):
        byte_firsts[k] = at
        first = True
        for i in range(src_firsts[k], src_firsts[k + 1]):
            t = ids[i]
            length = (record[t, 0] >> LEN_SHIFT) & LEN_MASK
            bounds[i] = at
            skip = 0
            if first and length:
                first = False
                if strips_leading_space and _byte(record, inline, blob, t, length, 0) == SPACE:
                    drop[k] = 1
                    skip = 1
            for x in range(skip, length):  # a loop: a slice copy costs four times as much at these lengths
                raw[at + x - skip] = _byte(record, inline, blob, t, length, x)
            at += length - skip
    byte_firsts[k_count] = at
    bounds[n] = at
    return -1, any_flags, raw[:at], bounds, byte_firsts, drop


@njit(cache=True, nogil=True)
def spell_one(ids, record, inline, blob, strips_leading_space):
    """`spell` of one completion, as few objects as a call can return: (bad, any_flags, drop, raw (L,) uint8,
    bounds (n+1,) int64). Each array a compiled call returns costs Python an allocation and a box, several
    microseconds right after an encode has evicted the caches."""
    firsts = np.empty(2, np.int64)
    firsts[0] = 0
    firsts[1] = ids.size
    bad, any_flags, raw, bounds, _, drop = spell(ids, firsts, record, inline, blob, strips_leading_space)
    return bad, any_flags, drop[0] if bad < 0 else 0, raw, bounds


@njit(cache=True, nogil=True, inline="always")
def _byte(record, inline, blob, t, length, x):
    """Byte x of token t (of `length` bytes): from its record if it fits there, else from the blob."""
    if length <= INLINE_BYTES:
        return inline[t, INLINE_AT + x]
    return blob[(record[t, 0] >> START_SHIFT) + x]


@njit(cache=True, nogil=True)
def _spells(dst_ids, a, b, record, inline, blob, raw, at, stop, skip):
    """Whether destination tokens a:b spell raw[at:stop], leaving out the first byte they hold if `skip`
    (which must be a space)."""
    for i in range(a, b):
        t = np.int64(dst_ids[i])
        if t >= record.shape[0]:
            return False
        length = (record[t, 0] >> LEN_SHIFT) & LEN_MASK
        first = 0
        if skip and length:
            if _byte(record, inline, blob, t, length, 0) != SPACE:
                return False
            first = 1
            skip = 0
        if at + length - first > stop:
            return False
        for x in range(first, length):
            if _byte(record, inline, blob, t, length, x) != raw[at + x - first]:
                return False
        at += length - first
    return at == stop


@njit(cache=True, nogil=True)
def _dst_side(dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts):
    """The destination runs laid end to end, each followed by `eos_id` where its source had end tokens
    (an EOS holds no bytes), and whether each run's tokens spell its text: shift 0 if as they are, 1 if
    after dropping a leading dummy-prefix space (where `strips_leading_space`; the run's first token
    then keeps the text's first byte), -1 if neither. Returns (ids, bounds, firsts, shift, forced)."""
    k_count = dst_firsts_in.size - 1
    n_eos = 0
    for k in range(k_count):
        n_eos += n_end[k] > 0
    m = len(dst_ids) + n_eos
    ids = np.empty(m, np.int64)
    bounds = np.empty(m + 1, np.int64)
    firsts = np.empty(k_count + 1, np.int64)
    shift = np.empty(k_count, np.int64)
    forced = np.empty(k_count + n_eos + 1, np.int64)
    j = 0
    f = 0
    for k in range(k_count):
        a, b = dst_firsts_in[k], dst_firsts_in[k + 1]
        at, stop = byte_firsts[k], byte_firsts[k + 1]
        skip = 0
        if not _spells(dst_ids, a, b, record, inline, blob, raw, at, stop, 0):
            skip = 1 if strips_leading_space and _spells(dst_ids, a, b, record, inline, blob, raw, at, stop, 1) else -1
        shift[k] = skip
        firsts[k] = j
        forced[f] = j
        f += 1
        drop = skip == 1
        for i in range(a, b):
            t = np.int64(dst_ids[i])
            ids[j] = t
            bounds[j] = at
            if skip >= 0:
                length = (record[t, 0] >> LEN_SHIFT) & LEN_MASK
                if drop and length:
                    length -= 1
                    drop = False
                at += length
            j += 1
        if n_end[k]:
            ids[j] = eos_id
            bounds[j] = stop
            forced[f] = j
            f += 1
            j += 1
    firsts[k_count] = j
    forced[f] = j
    bounds[m] = byte_firsts[k_count]
    return ids, bounds, firsts, shift, forced


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
    ids, dst_bounds, dst_firsts, shift, dst_forced = _dst_side(
        dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts
    )
    for k in range(shift.size):
        if shift[k] < 0:
            return shift, ids, dst_firsts, False, np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64)
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
    return shift, ids, dst_firsts, ok, src_group, dst_group, group_firsts, own_src_at, own_dst_at, own_chars, n_dst, inexact



_READY = []


def compile_all() -> None:
    """Compile (or load from the disk cache) every kernel for the types the bridge passes, once per process,
    on a one-token vocabulary: a first compile takes seconds, and should happen when a bridge is built
    (a learner's start), not at its first peer experience."""
    if _READY:
        return
    record = np.zeros((1, 2), np.int64)
    record[0, 0] = 2 | 1 << LEN_SHIFT  # a one-byte token starting a character
    inline = record.view(np.uint8)
    inline[0, INLINE_AT] = ord("a")
    blob = np.frombuffer(b"a", dtype=np.uint8)
    for ids in (np.zeros(1, np.int64), np.zeros(1, np.int32)):
        _, _, _, raw, bounds = spell_one(ids, record, inline, blob, False)
        _, _, _, _, byte_firsts, _ = spell(ids, np.array([0, 1], np.int64), record, inline, blob, False)
    from array import array

    dst = array("I", [0])
    _, _, _, m, _, ints, n_dst = align_one(dst, 0, 0, record, inline, blob, False, raw, bounds)
    one = np.ones(1, np.int64)
    out = align_batch(dst, np.array([0, 1], np.int64), one * 0, 0, record, inline, blob, False, raw, byte_firsts,
                      bounds, np.array([0, 1], np.int64))
    ints.setflags(write=False)  # as the bridge passes them: shared with its cache
    n_dst.setflags(write=False)
    for array_ in (out[4], out[5], out[10]):
        array_.setflags(write=False)
    for dtype in (np.float64, np.float32):
        spread(ints[2 * m :], ints[m : 2 * m], n_dst, np.zeros(1, dtype))  # views of a packed single alignment
        spread(out[4], out[5], out[10], np.zeros(1, dtype))  # the batch's own arrays
    _READY.append(True)
