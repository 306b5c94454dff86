"""One completion: the rules of `retokenize.py` for K = 1, the path of every `Bridge.__call__` miss.

Why a second front end: at a few hundred tokens a call costs about as much in Python bookkeeping as
in the work itself, and the batch front end's bookkeeping (per-completion lists, dicts, loops over K)
is pure overhead for one text. This one keeps only what a single completion needs and runs the same
compiled loops (`fastspell.py`, `fastalign.py`) as a batch, so both front ends give identical results: one
call before the destination encode (`spell_one`: checks the ids, spells the text) and one after it. Anything off
the fast path (no exact destination table, tokens that do not spell the text) takes the same
`fallback.py` route as in a batch.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from tokenbridge import fastalign, fastspell
from tokenbridge.align import Groups, SpanAlignment
from tokenbridge.checks import checked_ids
from tokenbridge.encoders import Encoders
from tokenbridge.errors import EmptyCompletionError
from tokenbridge.profile import SPECIAL, VocabProfile
from tokenbridge.retokenize import Aligned, Source, aligned_by_offsets, decoded_text, eos_only, split_eos

EMPTY = "src_ids decode to empty text and carry no EOS: there is nothing to bridge"


@dataclass(slots=True, eq=False)
class SpelledOne:
    """One completion's source side: its UTF-8 (a dropped dummy-prefix space left out) and token starts."""

    raw: np.ndarray  # (L,) uint8
    bounds: np.ndarray  # (n+1,) int64 start byte of each token in raw, then L
    drop: int  # 1 if a dummy-prefix space was dropped
    any_flags: int  # flags of all tokens or-ed (profile.SPECIAL, ...)


def spell_one(src: VocabProfile, ids: np.ndarray) -> SpelledOne:
    """Spell 1-D int32/int64 ids; raises `InvalidTokenIdError` (via `checked_ids`) for an id outside the vocabulary."""
    bad, any_flags, drop, raw, bounds = fastspell.spell_one(
        ids, src.record, src.inline, src.blob, src.strips_leading_space
    )
    if bad >= 0:
        checked_ids(src, ids)  # raises, naming the position and the value as given
    return SpelledOne(raw, bounds, drop, any_flags)


def align_one(
    src: VocabProfile, dst: VocabProfile, encoders: Encoders, ids: np.ndarray, spelled: SpelledOne, dst_eos_id
) -> Aligned:
    """Align spelled source ids onto the destination's encoding of their text; raises a `BridgeError`
    where `retokenize_many` would return one."""
    n_end = 0
    if spelled.any_flags & SPECIAL:
        n_end = split_eos(src, ids, (src.flag.take(ids) & SPECIAL).view(bool), dst_eos_id)
    if not spelled.raw.size:
        if n_end:
            return eos_only(len(ids), dst_eos_id)
        raise EmptyCompletionError(EMPTY)
    text = decoded_text(spelled.raw)
    dst_list = encoders.ids_one(text)
    if dst.exact:
        dst_flat = array("I")
        dst_flat.fromlist(dst_list)  # faster than array("I", dst_list)
        shift, ok, inexact, m, g_count, ints, n_dst = fastalign.align_one(
            dst_flat, n_end, 0 if dst_eos_id is None else dst_eos_id, dst.record, dst.inline, dst.blob,
            dst.strips_leading_space, spelled.raw, spelled.bounds,
        )
        if shift >= 0:
            assert ok, "every cut opens a group on both sides"
            return _unpacked(text, ints, n_dst, m, len(ids), g_count + 1, inexact, n_end)
    source = Source(np.asarray(ids, dtype=np.int64), n_end, spelled.raw.tobytes(), spelled.drop, text)
    return aligned_by_offsets(src, dst, encoders.full, source, dst_list, dst_eos_id)


def _unpacked(text: str, ints: np.ndarray, n_dst: np.ndarray, m: int, n: int, g1: int, inexact: int, n_end: int) -> Aligned:
    """The `Aligned` of `fastalign.align_one`'s packed arrays: read-only views (shared with the cache), made
    read-only once, on the buffer, so every view is."""
    ints.setflags(write=False)
    n_dst.setflags(write=False)
    g = 2 * m + n
    groups = Groups(ints[g : g + g1], ints[g + g1 : g + 2 * g1], ints[g + 2 * g1 :])
    span = SpanAlignment(ints[2 * m : g], ints[m : 2 * m], groups, inexact / len(text))
    return Aligned(text, ints[:m], span, n_dst, bool(n_end))
