"""Compiling the fast path's kernels (`fastspell.py`, `fastalign.py`) once per process, when a bridge is built."""

from __future__ import annotations

import numpy as np

from tokenbridge.fastalign import align_batch, align_one, spread
from tokenbridge.fastspell import INLINE_AT, LEN_SHIFT, spell, spell_one


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
