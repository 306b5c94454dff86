"""Compiled loops that spell token ids as bytes through a vocabulary's packed record table
(`VocabProfile.record`: 16 bytes per id holding its flags, byte length, start in the byte blob, and its
bytes if it has at most 8): the source side (`spell`, `spell_one`: ids checked, the completions' text
and each token's start byte) and the destination side (`dst_side`: the destination's tokens checked to
spell that text, laid out with their EOS for `fastalign.align`).

K completions are laid end to end: completion k owns source tokens src_firsts[k]:src_firsts[k+1],
destination tokens dst_firsts[k]:dst_firsts[k+1], and bytes byte_firsts[k]:byte_firsts[k+1] of `raw`
(the UTF-8 of its text, a dropped dummy-prefix space left out).
"""

from __future__ import annotations

import numpy as np

from tokenbridge.jit import njit

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
def dst_side(dst_ids, dst_firsts_in, n_end, eos_id, record, inline, blob, strips_leading_space, raw, byte_firsts):
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
