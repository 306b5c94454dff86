"""One completion: the rules of `retokenize.py` for K = 1, the path of every `Bridge.__call__` miss.

Why a second front end: at a few hundred tokens a call costs about as much in Python bookkeeping as
in numpy work, and the batch front end's bookkeeping (per-completion lists, dicts, loops over K) is
pure overhead for one text. This one keeps only what a single completion needs, then hands the same
`Laid` to the shared alignment core (`spans.align_laid`), so both front ends give identical results.
Anything off the fast path (no exact destination table, tokens that do not spell the text) takes the
same `fallback.py` route as in a batch.
"""

from __future__ import annotations

from array import array

import numpy as np

from tokenbridge.encoders import Encoders
from tokenbridge.errors import EmptyCompletionError
from tokenbridge.profile import SPECIAL, VocabProfile
from tokenbridge.retokenize import Aligned, Source, _decoded, _eos_only, _shift, _slow, _spelled, split_eos
from tokenbridge.spans import Laid, Side, align_laid, drop_leading

EMPTY = "src_ids decode to empty text and carry no EOS: there is nothing to bridge"


def align_one(src: VocabProfile, dst: VocabProfile, encoders: Encoders, ids: np.ndarray, dst_eos_id) -> Aligned:
    """Align validated, non-empty source ids onto the destination's encoding of their text; raises a
    `BridgeError` where `retokenize_many` would return one."""
    spelled = src.spell(ids)
    n_end = 0
    if spelled.any_flags & SPECIAL:
        n_end = split_eos(src, ids, (spelled.flags & SPECIAL).view(bool), dst_eos_id)
    raw = spelled.raw
    drop = int(src.strips_leading_space and raw[:1] == b" ")
    if drop:
        raw = raw[1:]
    if not raw:
        if n_end:
            return _eos_only(len(ids), dst_eos_id)
        raise EmptyCompletionError(EMPTY)
    text = _decoded(raw)
    source = Source(ids, n_end, raw, drop, text)
    dst_list = encoders.ids([text])[0]
    if not dst.exact:
        return _slow(src, dst, encoders.full, source, dst_list, dst_eos_id)
    dst_side, shift = _dst_one(dst, dst_list, source, dst_eos_id)
    if shift is None:
        return _slow(src, dst, encoders.full, source, dst_list, dst_eos_id)
    bounds = spelled.bounds
    if drop:
        bounds[1:] -= 1  # as `drop_leading` does for one completion: the first token keeps byte 0
    if shift:
        drop_leading(dst_side.bounds, dst_side.firsts, [shift])
    ends = [len(ids) - n_end] if n_end else []
    src_side = Side(ids, bounds, [0, len(ids)], ends, spelled.flags, spelled.any_flags)
    piece = align_laid(src, dst, Laid(src_side, dst_side, raw, [0, len(raw)], [len(text)], [drop]))[0]
    return Aligned(text, piece.dst_ids, piece.span, piece.n_dst_per_group, bool(n_end))


def _dst_one(dst: VocabProfile, dst_list: list[int], source: Source, dst_eos_id) -> tuple[Side, int | None]:
    """The destination side (its EOS last if the source had end tokens), and 0 or 1 (a dummy-prefix
    space in front) if its tokens spell the text, else None; see `retokenize._dst_side`."""
    packed = array("I", dst_list)  # the fastest list -> array
    ends: list[int] = []
    if source.n_end:
        ends.append(len(packed))
        packed.append(dst_eos_id)
    ids = np.frombuffer(packed, dtype=np.uint32).astype(np.int64)
    by_length = dst.text_guard is not None and dst.text_guard(source.text)  # then equal length is equal bytes
    spelled = dst.spell(ids, ends, text=not by_length)
    if by_length:
        shift = _shift(dst, int(spelled.bounds[-1]) - len(source.raw))
    else:
        shift = _spelled(dst, spelled.raw, source.raw)
    return Side(ids, spelled.bounds, [0, len(ids)], ends, spelled.flags, spelled.any_flags), shift
