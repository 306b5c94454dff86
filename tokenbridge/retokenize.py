"""Source ids -> text -> destination ids, aligned: the log-prob independent (cacheable) part of a bridge.

- A trailing run of end tokens (EOS, `<|im_end|>`, `</s>`, ...) maps to ONE destination EOS in its own
  zero-character group; any other special token raises `SpecialTokenError`.
- The text is the concatenation of the source tokens' bytes (SentencePiece's dummy-prefix space
  stripped, as its decoder does); invalid UTF-8 raises `UndecodableTextError`.
- Destination ids are the destination's own encoding of the text without special tokens, with
  literal special-token strings kept as text (`encode_special_tokens`), no truncation, no padding.
- Completions are retokenized a batch at a time: one batch encode without offsets, then, for every
  completion whose destination token bytes spell its text exactly (after at most SentencePiece's one
  dummy-prefix space), one batch alignment by cumulative byte lengths (`spans.py`). The others (a
  normalizer changed characters, e.g. Qwen2's NFC on a non-NFC text) take `fallback.py`, whose
  results are exact too.
- A failure belongs to its completion: it is returned in that completion's place, never raised.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from tokenbridge.align import Groups, SpanAlignment, chars_before, char_start_mask
from tokenbridge.errors import (
    AlignmentError,
    BridgeError,
    EmptyCompletionError,
    SpecialTokenError,
    UndecodableTextError,
)
from tokenbridge.fallback import slow_span, with_eos
from tokenbridge.encoders import Encoders
from tokenbridge.profile import SPECIAL, Spelled, VocabProfile
from tokenbridge.spans import Laid, Side, align_laid, drop_leading


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
    """Align each validated, non-empty source id array onto the destination's encoding of its text."""
    firsts = _running([len(run) for run in batch])
    spelled = src.spell(batch[0] if len(batch) == 1 else np.concatenate(batch))
    results: dict[int, Aligned | BridgeError] = {}
    texts: list[tuple[int, Source]] = []
    for k, source in enumerate(_sources(src, spelled, firsts, batch, dst_eos_id)):
        if isinstance(source, BridgeError):
            results[k] = source
        elif source.raw:
            texts.append((k, source))
        elif source.n_end:
            results[k] = _eos_only(len(source.ids), dst_eos_id)
        else:
            results[k] = EmptyCompletionError("src_ids decode to empty text and carry no EOS: there is nothing to bridge")
    if not texts:
        return [results[k] for k in range(len(batch))]
    lists = encoders.ids([source.text for _, source in texts])
    fast: list[int] = []  # indices into texts of the completions whose destination tokens spell their text
    if dst.exact:
        dst_side, shifts = _dst_side(dst, lists, texts, dst_eos_id)
        fast = [i for i, shift in enumerate(shifts) if shift is not None]
    for i in sorted(set(range(len(texts))) - set(fast)):
        k, source = texts[i]
        try:
            results[k] = _slow(src, dst, encoders.full, source, lists[i], dst_eos_id)
        except BridgeError as exc:
            results[k] = exc
    if fast:
        if len(fast) < len(batch):  # the sides must hold exactly the completions that go on
            kept = [batch[texts[i][0]] for i in fast]
            spelled, firsts = src.spell(np.concatenate(kept)), _running([len(run) for run in kept])
            dst_side = _dst_side(dst, [lists[i] for i in fast], [texts[i] for i in fast], dst_eos_id)[0]
        laid = _laid(spelled, firsts, dst_side, [texts[i][1] for i in fast], [shifts[i] for i in fast])
        for i, piece in zip(fast, align_laid(src, dst, laid)):
            k, source = texts[i]
            results[k] = Aligned(source.text, piece.dst_ids, piece.span, piece.n_dst_per_group, bool(source.n_end))
    return [results[k] for k in range(len(batch))]


def _running(counts: list[int]) -> list[int]:
    """(K+1,) where each run starts when laid end to end, then the total."""
    firsts = [0]
    for count in counts:
        firsts.append(firsts[-1] + count)
    return firsts


def _sources(
    src: VocabProfile, spelled: Spelled, firsts: list[int], batch: list[np.ndarray], dst_eos_id: int | None
) -> list[Source | BridgeError]:
    """Each completion's text, cut from the batch's bytes (end tokens have none)."""
    special = (spelled.flags & SPECIAL).view(bool) if spelled.any_flags & SPECIAL else None
    at = [0, len(spelled.raw)] if len(batch) == 1 else spelled.bounds[firsts].tolist()
    out: list[Source | BridgeError] = []
    for k, ids in enumerate(batch):
        try:
            n_end = 0 if special is None else split_eos(src, ids, special[firsts[k] : firsts[k + 1]], dst_eos_id)
            raw = spelled.raw if len(batch) == 1 else spelled.raw[at[k] : at[k + 1]]
            drop = int(src.strips_leading_space and raw[:1] == b" ")
            if drop:
                raw = raw[1:]
            out.append(Source(ids, n_end, raw, drop, _decoded(raw)))
        except BridgeError as exc:
            out.append(exc)
    return out


def _decoded(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UndecodableTextError(
            f"source ids decode to invalid UTF-8 at byte {exc.start} of {len(raw)} (completion cut inside a character?)"
        ) from None


def _dst_side(
    dst: VocabProfile, lists: list[list[int]], texts: list[tuple[int, Source]], dst_eos_id: int | None
) -> tuple[Side, list[int | None]]:
    """The destination runs laid end to end (each with its EOS if its source had end tokens), and for each
    run 0 or 1 (a dummy-prefix space in front) if its tokens spell its text, else None."""
    flat: list[int] = []
    firsts, ends = [0], []
    for ids, (_, source) in zip(lists, texts):
        flat += ids
        if source.n_end:
            ends.append(len(flat))
            flat.append(dst_eos_id)
        firsts.append(len(flat))
    ids_array = np.frombuffer(array("I", flat), dtype=np.uint32).astype(np.int64)  # the fastest list -> array
    guard = dst.text_guard if dst.exact else None  # if it holds, comparing lengths is comparing bytes
    by_length = guard is not None and all(guard(source.text) for _, source in texts)
    spelled = dst.spell(ids_array, ends, text=not by_length)  # an EOS stands for no text, even a text token
    at = spelled.bounds[firsts].tolist()
    if by_length:
        shifts = [_shift(dst, b - a - len(source.raw)) for a, b, (_, source) in zip(at, at[1:], texts)]
    else:
        raw_all = spelled.raw
        shifts = [_spelled(dst, raw_all[a:b] if len(lists) > 1 else raw_all, source.raw)
                  for a, b, (_, source) in zip(at, at[1:], texts)]
    return Side(ids_array, spelled.bounds, firsts, ends, spelled.flags, spelled.any_flags), shifts


def _shift(dst: VocabProfile, extra: int) -> int | None:
    """The dummy-prefix shift that `extra` destination bytes mean, under the text guard; None if no shift can."""
    if extra == 0:
        return 0
    return 1 if extra == 1 and dst.strips_leading_space else None


def _spelled(dst: VocabProfile, dst_raw: bytes, raw: bytes) -> int | None:
    """0 or 1 (a dummy-prefix space in front) if the destination bytes spell `raw`, else None."""
    if dst_raw == raw:
        return 0
    if dst.strips_leading_space and len(dst_raw) == len(raw) + 1 and dst_raw[:1] == b" " and dst_raw.endswith(raw):
        return 1
    return None


def _laid(spelled: Spelled, firsts: list[int], dst: Side, sources: list[Source], shifts: list) -> Laid:
    """The fast completions end to end, both sides in text bytes (dropped leading spaces taken out)."""
    drop = [source.drop for source in sources]
    bounds = spelled.bounds
    if any(drop):
        drop_leading(bounds, firsts, drop)
    if any(shifts):
        drop_leading(dst.bounds, dst.firsts, shifts)
    ends = [end - source.n_end for end, source in zip(firsts[1:], sources) if source.n_end]
    ids = sources[0].ids if len(sources) == 1 else np.concatenate([source.ids for source in sources])
    src = Side(ids, bounds, firsts, ends, spelled.flags, spelled.any_flags)
    raw = sources[0].raw if len(sources) == 1 else b"".join(source.raw for source in sources)
    byte_firsts = _running([len(source.raw) for source in sources])
    return Laid(src, dst, raw, byte_firsts, [len(source.text) for source in sources], drop)


def _slow(
    src: VocabProfile, dst: VocabProfile, encoder: Tokenizer, source: Source, dst_list: list[int], dst_eos_id
) -> Aligned:
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


def _eos_only(n_src: int, dst_eos_id: int) -> Aligned:
    """A completion that is only end tokens (or decodes to nothing before them): one group, one EOS."""
    groups = Groups(src=np.array([0, n_src]), dst=np.array([0, 1]), chars=np.array([0, 0]))
    span = SpanAlignment(np.zeros(n_src, np.int64), np.zeros(1, np.int64), groups, 0.0)
    return _frozen(Aligned("", np.array([dst_eos_id], dtype=np.int64), span, np.ones(1), True))
