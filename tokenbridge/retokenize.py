"""Source ids -> text -> destination ids, aligned: the log-prob independent (cacheable) part of a bridge.

- A trailing run of end tokens (EOS, `<|im_end|>`, `</s>`, ...) maps to ONE destination EOS in its own
  zero-character group; any other special token raises `SpecialTokenError`.
- The text is the concatenation of the source tokens' bytes (SentencePiece's dummy-prefix space
  stripped, as its decoder does); invalid UTF-8 raises `UndecodableTextError`.
- Destination ids are the destination's own encoding of the text without special tokens, with
  literal special-token strings kept as text (`encode_special_tokens`), no truncation, no padding.
- Completions are retokenized a batch at a time: one batch encode without offsets, then, for every
  completion whose destination token bytes spell its text exactly (after at most SentencePiece's one
  dummy-prefix space), one batch alignment by cumulative byte lengths (`fastspell.py`, `fastalign.py`).
  The others (a normalizer changed characters, e.g. Qwen2's NFC on a non-NFC text) take `fallback.py`,
  whose results are exact too.
- A failure belongs to its completion: it is returned in that completion's place, never raised.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
from tokenizers import Tokenizer

from tokenbridge.align import Groups, SpanAlignment, chars_before, char_start_mask
from tokenbridge.checks import checked_ids
from tokenbridge.errors import (
    AlignmentError,
    BridgeError,
    EmptyCompletionError,
    SpecialTokenError,
    UndecodableTextError,
)
from tokenbridge.fallback import slow_span, with_eos
from tokenbridge import fastalign, fastspell
from tokenbridge.encoders import Encoders
from tokenbridge.profile import SPECIAL, VocabProfile


@dataclass(frozen=True, eq=False)
class Aligned:
    """A completion in destination tokens, without log-probs or masks; arrays are read-only."""

    text: str
    dst_ids: np.ndarray  # (n_dst,) int64
    span: SpanAlignment
    n_dst_per_group: np.ndarray  # (G,) float64, the divisor that spreads a group's log-prob sum
    eos: bool


@dataclass(slots=True, eq=False)
class Source:
    """One completion's source side, ready to encode."""

    ids: np.ndarray  # (n,) int64, validated, end tokens included
    n_end: int  # trailing end tokens
    raw: bytes  # UTF-8 of the text
    drop: int  # 1 if a dummy-prefix space was dropped in front of raw
    text: str


def _frozen(aligned: Aligned) -> Aligned:
    span = aligned.span
    groups = span.groups
    for array_ in (aligned.dst_ids, span.src_group, span.dst_group, groups.src, groups.dst, groups.chars):
        array_.flags.writeable = False
    return aligned


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


def split_eos(profile: VocabProfile, ids: np.ndarray, special: np.ndarray, dst_eos_id: int | None) -> int:
    """The number of trailing end tokens; raises on any other special token. special: (n,) the ids' flags."""
    if not special.any():
        return 0
    n_end = 0
    while n_end < len(ids) and int(ids[len(ids) - 1 - n_end]) in profile.end_ids:
        n_end += 1
    n_body = len(ids) - n_end
    if special[:n_body].any():
        pos = int(np.argmax(special[:n_body]))
        raise SpecialTokenError(
            f"src_ids[{pos}] = {int(ids[pos])} is a special token inside the completion; only trailing end"
            " tokens (EOS) can cross the bridge"
        )
    if dst_eos_id is None:
        raise SpecialTokenError(
            "the completion ends with EOS but the destination tokenizer has no EOS token; pass Bridge(dst_eos_id=...)"
        )
    return n_end


def retokenize_many(
    src: VocabProfile, dst: VocabProfile, encoders: Encoders, batch: list[np.ndarray], dst_eos_id: int | None
) -> list[Aligned | BridgeError]:
    """Align each validated, non-empty source id array onto the destination's encoding of its text.

    The whole batch is one batch encode (it spreads over every core) and one alignment. Encoding it
    as two halves, one aligning while the other encodes, was measured slower: some tokenizers (GPT-2's)
    encode two half batches in well over the time of one whole batch."""
    results: dict[int, Aligned | BridgeError] = {}
    texts: list[tuple[int, Source]] = []
    sources, spelled = _sources(src, batch, dst_eos_id)
    for k, source in enumerate(sources):
        if isinstance(source, BridgeError):
            results[k] = source
        elif source.raw:
            texts.append((k, source))
        elif source.n_end:
            results[k] = eos_only(len(source.ids), dst_eos_id)
        else:
            results[k] = EmptyCompletionError("src_ids decode to empty text and carry no EOS: there is nothing to bridge")
    if texts:
        lists = encoders.ids([source.text for _, source in texts])
        slow = list(range(len(texts)))
        if dst.exact:  # the batch's spelling serves again when every completion has text (the usual case)
            slow = _fast(src, dst, texts, lists, dst_eos_id, results, spelled if len(texts) == len(batch) else None)
        for i in slow:
            k, source = texts[i]
            try:
                results[k] = aligned_by_offsets(src, dst, encoders.full, source, lists[i], dst_eos_id)
            except BridgeError as exc:
                results[k] = exc
    return [results[k] for k in range(len(batch))]


def _spelled_runs(src: VocabProfile, runs: list[np.ndarray]) -> tuple:
    """`fastspell.spell` of validated id runs laid end to end: (any_flags, raw, bounds, byte_firsts, drop,
    src_firsts)."""
    firsts = np.array(list(accumulate(map(len, runs), initial=0)), dtype=np.int64)
    ids = runs[0] if len(runs) == 1 else np.concatenate(runs)
    bad, any_flags, raw, bounds, byte_firsts, drop = fastspell.spell(
        ids, firsts, src.record, src.inline, src.blob, src.strips_leading_space
    )
    if bad >= 0:
        return None
    return any_flags, raw, bounds, byte_firsts, drop, firsts


def _sources_with_bad_ids(src: VocabProfile, batch: list[np.ndarray], dst_eos_id: int | None) -> list[Source | BridgeError]:
    """`_sources` of a batch holding ids outside the vocabulary: each such completion gets the error a call
    would raise (naming the position and the value as given), the others their sources."""
    out: list[Source | BridgeError] = []
    for ids in batch:
        try:
            checked_ids(src, ids)
        except BridgeError as exc:
            out.append(exc)
            continue
        out.extend(_sources(src, [ids], dst_eos_id)[0])
    return out


def _sources(src: VocabProfile, batch: list[np.ndarray], dst_eos_id: int | None) -> tuple[list[Source | BridgeError], tuple | None]:
    """Each completion's text, cut from the batch's bytes (end tokens have none), and the batch's spelling
    (None if some ids were outside the vocabulary: those completions get `checked_ids`'s error)."""
    spelled = _spelled_runs(src, batch)
    if spelled is None:
        return _sources_with_bad_ids(src, batch, dst_eos_id), None
    any_flags, raw, _, byte_firsts, drop, firsts = spelled
    raw_all, at, drops, firsts = raw.tobytes(), byte_firsts.tolist(), drop.tolist(), firsts.tolist()
    special = None
    if any_flags & SPECIAL:
        special = (src.flag.take(batch[0] if len(batch) == 1 else np.concatenate(batch)) & SPECIAL).view(bool)
    out: list[Source | BridgeError] = []
    for k, ids in enumerate(batch):
        try:
            n_end = 0 if special is None else split_eos(src, ids, special[firsts[k] : firsts[k + 1]], dst_eos_id)
            text_raw = raw_all if len(batch) == 1 else raw_all[at[k] : at[k + 1]]
            out.append(Source(ids, n_end, text_raw, drops[k], decoded_text(text_raw)))
        except BridgeError as exc:
            out.append(exc)
    return out, spelled


def _fast(
    src: VocabProfile, dst: VocabProfile, texts: list[tuple[int, Source]], lists: list[list[int]], dst_eos_id,
    results: dict, spelled: tuple | None = None,
) -> list[int]:
    """Align, into `results`, every completion whose destination tokens spell its text (after at most one
    dummy-prefix space); return the indices into `texts` of the others. `spelled`: `_spelled_runs` of
    exactly these completions' ids, if the caller has it."""
    sources = [source for _, source in texts]
    if spelled is None:
        spelled = _spelled_runs(src, [source.ids for source in sources])
    _, raw, bounds, byte_firsts, _, src_firsts = spelled
    flat = array("I")
    dst_firsts = [0]
    for ids in lists:
        flat.fromlist(ids)  # five times faster than extend, or than numpy, from a list of ints
        dst_firsts.append(len(flat))
    n_end = np.array([source.n_end for source in sources], dtype=np.int64)
    out = fastalign.align_batch(
        flat, np.array(dst_firsts, dtype=np.int64), n_end, 0 if dst_eos_id is None else dst_eos_id, dst.record,
        dst.inline, dst.blob, dst.strips_leading_space, raw, byte_firsts, bounds, src_firsts,
    )
    shift, dst_ids, dst_firsts_out, ok = out[:4]
    slow = [i for i, value in enumerate(shift.tolist()) if value < 0]
    if slow:  # align the others without them (the sides must hold exactly the completions that go on)
        keep = sorted(set(range(len(texts))) - set(slow))
        if keep:
            rest = _fast(src, dst, [texts[i] for i in keep], [lists[i] for i in keep], dst_eos_id, results)
            assert not rest, "a completion that spells its text alone spells it in any batch"
        return slow
    assert ok, "every cut opens a group on both sides"
    for array_ in out[1:]:
        if isinstance(array_, np.ndarray):
            array_.setflags(write=False)  # shared with the cache; the slices below are read-only views
    src_group, dst_group, group_firsts, src_at, dst_at, chars, n_dst, inexact = out[4:]
    s_at, d_at, g_at, wrong = src_firsts.tolist(), dst_firsts_out.tolist(), group_firsts.tolist(), inexact.tolist()
    for i, (k, source) in enumerate(texts):
        g0, g1 = g_at[i], g_at[i + 1]
        own = slice(g0 + i, g1 + i + 1)
        groups = Groups(src_at[own], dst_at[own], chars[own])
        span = SpanAlignment(
            src_group[s_at[i] : s_at[i + 1]], dst_group[d_at[i] : d_at[i + 1]], groups, wrong[i] / len(source.text)
        )
        results[k] = Aligned(source.text, dst_ids[d_at[i] : d_at[i + 1]], span, n_dst[g0:g1], bool(source.n_end))
    return []


def decoded_text(raw: bytes | np.ndarray) -> str:
    """The completion's text (raw: bytes, or a uint8 array, decoded in place); a cut inside a UTF-8 character
    is an ``UndecodableTextError``."""
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise UndecodableTextError(
            f"source ids decode to invalid UTF-8 at byte {exc.start} of {len(raw)} (completion cut inside a character?)"
        ) from None


def aligned_by_offsets(
    src: VocabProfile, dst: VocabProfile, encoder: Tokenizer, source: Source, dst_list: list[int], dst_eos_id
) -> Aligned:
    """The general path: spans from the destination's own offsets (text that normalises or merges across
    the source's token boundaries in ways the per-token tables cannot follow)."""
    if not dst_list:
        raise AlignmentError(
            f"the destination tokenizer encodes the {len(source.text)}-character completion as no tokens"
        )
    body = source.ids[: len(source.ids) - source.n_end]
    raw, src_starts = _stripped(src, *src.gather(body))
    dst_ids = np.array(dst_list, dtype=np.int64)
    span = slow_span(dst, encoder, raw, source.text, src_starts, dst_ids)
    if source.n_end:
        span, dst_ids = with_eos(span, dst_ids, source.n_end, dst_eos_id)
    n_dst_per_group = np.diff(span.groups.dst).astype(np.float64)
    return _frozen(Aligned(source.text, dst_ids, span, n_dst_per_group, bool(source.n_end)))


def eos_only(n_src: int, dst_eos_id: int) -> Aligned:
    """A completion that is only end tokens (or decodes to nothing before them): one group, one EOS."""
    groups = Groups(src=np.array([0, n_src]), dst=np.array([0, 1]), chars=np.array([0, 0]))
    span = SpanAlignment(np.zeros(n_src, np.int64), np.zeros(1, np.int64), groups, 0.0)
    return _frozen(Aligned("", np.array([dst_eos_id], dtype=np.int64), span, np.ones(1), True))
