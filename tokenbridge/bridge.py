"""The bridge: a source model's completion ids (+ behaviour log-probs, mask) -> the destination's terms.

Rules, in the order they apply:

- Only the completion crosses; it must be non-empty, its ids inside the source vocabulary, and
  log-probs / mask (if given) one per id, log-probs finite, mask booleans or 0/1. Anything else is
  a `BridgeError`.
- A trailing run of end tokens (the source's EOS, `<|im_end|>`, `</s>`, ...) maps to ONE destination
  EOS token (its own zero-character group), never to text. Any other special token, or one in the
  middle of the completion, raises `SpecialTokenError`: a control token has no text to align.
- The text is the concatenation of the source tokens' bytes (SentencePiece's dummy-prefix space
  stripped, as its decoder does). Bytes that are not valid UTF-8 (a completion cut inside a
  character) raise `UndecodableTextError` and are counted in `stats.undecodable`.
- Destination ids are the destination's own encoding of that text without special tokens. Literal
  special-token strings in the text stay text (`encode_special_tokens`), so a peer cannot inject
  control tokens; truncation and padding of the destination tokenizer are ignored.
- Log-probs: each group's source sum is spread UNIFORMLY over its destination tokens, so every
  group sum is conserved (float64); a group whose sum overflows float64 raises
  `NonFiniteLogprobError`. Masks: a destination token is in the loss only if EVERY source token of
  its group was (a group is never half-trained).
- Same tokenizer (same serialized fingerprint): identity, ids passed through untouched (a
  non-canonical tokenization the generator sampled stays as sampled), residual 0.
- Results of a given source id sequence are cached (LRU): the alignment does not depend on the
  log-probs, which are re-spread per call. Id and group arrays are read-only (shared with the cache).
- `Bridge.batch` gives, completion by completion, what one call each would give (the error in place
  of a raise), with one destination batch encode and one alignment for the whole batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
from transformers import PreTrainedTokenizerFast

from tokenbridge import fastalign, warmup
from tokenbridge.align import Groups
from tokenbridge.checks import checked_ids, checked_logprobs, checked_mask, nonfinite_logprobs
from tokenbridge.errors import BridgeError, UndecodableTextError, UnsupportedTokenizerError
from tokenbridge.profile import profile_of
from tokenbridge.encoders import encoders_for
from tokenbridge.retokenize import Aligned, identity, retokenize_many
from tokenbridge.single import SpelledOne, align_one, spell_one

Checked = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]  # ids (n,) int64, log-probs (n,) float64, mask (n,) bool


@dataclass(frozen=True, eq=False)
class BridgedCompletion:
    """A completion in destination tokens. Alignment rule: dst_ids, dst_logprobs, dst_mask and dst_group
    share one length; groups.dst indexes them, groups.src indexes the source ids."""

    text: str  # the completion text (without EOS)
    dst_ids: np.ndarray  # (n_dst,) int64 destination ids, EOS last if the source ended with one
    dst_logprobs: np.ndarray | None  # (n_dst,) float64 behaviour log-probs; None if none were given
    dst_mask: np.ndarray  # (n_dst,) bool loss mask
    dst_group: np.ndarray  # (n_dst,) int64 aligned-group id of each destination token
    src_group: np.ndarray  # (n_src,) int64 aligned-group id of each source token
    groups: Groups  # (G+1,) boundaries in src tokens, dst tokens and characters
    residual: float  # fraction of characters in groups that are not one-to-one, in [0, 1]
    eos: bool  # the source ended with an end token, mapped to the destination EOS
    identity: bool  # same tokenizer: ids passed through


class BridgeStats(msgspec.Struct, gc=False):
    """Counters of one Bridge; read by the engine's monitor."""

    bridged: int = 0  # successful calls, cached or not
    cache_hits: int = 0
    rejected: int = 0  # calls that raised a BridgeError (all kinds)
    undecodable: int = 0  # of which: source bytes not valid UTF-8
    residual_chars: float = 0.0  # sum over bridged calls of residual * characters
    chars: int = 0  # characters bridged


class Bridge:
    """Retokenize and align completions from `src_tokenizer` onto `dst_tokenizer`; see the module doc.

    dst_eos_id: id that a source end token maps to (default: the destination's eos_token_id).
    cache_size: number of distinct source id sequences whose alignment is kept (0 disables).
    """

    def __init__(
        self,
        src_tokenizer: PreTrainedTokenizerFast,
        dst_tokenizer: PreTrainedTokenizerFast,
        cache_size: int = 4096,
        dst_eos_id: int | None = None,
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.src = profile_of(src_tokenizer)
        self.dst = profile_of(dst_tokenizer)
        self.identity = src_tokenizer is dst_tokenizer or self.src.fingerprint == self.dst.fingerprint
        if not self.identity and not self.src.exact:
            raise UnsupportedTokenizerError(
                "source tokenizer's decode is not a concatenation of its token bytes (neither byte-level BPE nor"
                " SentencePiece); it cannot be a THL source"
            )
        self.dst_eos_id = self.dst.eos_id if dst_eos_id is None else int(dst_eos_id)
        self.cache_size = cache_size
        self.stats = BridgeStats()
        self._cache: OrderedDict[bytes, Aligned] = OrderedDict()
        self._encoders = None if self.identity else encoders_for(dst_tokenizer.backend_tokenizer, self.dst)
        warmup.compile_all()

    def __call__(self, src_ids, logprobs=None, mask=None) -> BridgedCompletion:
        """Bridge one completion: src_ids (n,) ints; logprobs (n,) floats or None; mask (n,) bools (or 0/1) or None.

        Raises a `BridgeError` subclass (counted in `stats.rejected`) when the completion cannot cross.
        """
        try:
            ids = self._ids(src_ids)
            aligned = self._lookup(ids) if self.cache_size else None
            hit = aligned is not None
            spelled = None if hit or self.identity else spell_one(self.src, ids)  # checks the ids first
            lp = _logprobs(logprobs, len(ids))
            msk = None if mask is None else checked_mask(mask, len(ids))
            if aligned is None:
                aligned = self._aligned_one(ids, spelled)
            out = self._spread(aligned, lp, msk)
        except BridgeError as exc:
            self._count_rejected(exc)
            raise
        self._count(aligned, hit)
        return out

    def batch(
        self,
        src_ids: Sequence,
        logprobs: Sequence | None = None,
        masks: Sequence | None = None,
    ) -> list[BridgedCompletion | BridgeError]:
        """Bridge K completions at once, e.g. the peer experiences waiting at a learner's ingest.

        src_ids: K id sequences; logprobs, masks: None, or K entries, each None or one value per token
        of its completion (as in a call). Returns K entries in order: the `BridgedCompletion` that a call
        would return, or the `BridgeError` it would raise, returned in its place and counted in `stats`
        the same way, so one bad completion never costs the others. The destination encodes all the
        texts in one batch encode (on all cores) and one alignment serves them all: much faster than
        K calls. Raises ValueError if logprobs or masks do not have K entries.
        """
        n = len(src_ids)
        lps, msks = _per_completion("logprobs", logprobs, n), _per_completion("masks", masks, n)
        out: dict[int, BridgedCompletion | BridgeError] = {}
        checked: dict[int, Checked] = {}
        for k in range(n):
            try:
                checked[k] = self._checked(src_ids[k], lps[k], msks[k])
            except BridgeError as exc:
                self._count_rejected(exc)
                out[k] = exc
        aligned = self._aligned_all({k: ids for k, (ids, _, _) in checked.items()})
        for k, (_, lp, msk) in checked.items():
            result, hit = aligned[k]
            try:
                if isinstance(result, BridgeError):
                    raise result
                out[k] = self._spread(result, lp, msk)
            except BridgeError as exc:
                self._count_rejected(exc)
                out[k] = exc
                continue
            self._count(result, hit)
        return [out[k] for k in range(n)]

    # -- input checks and counters ----------------------------------------------------------------

    def _ids(self, src_ids) -> np.ndarray:
        """1-D int32 or int64 ids as given, whose range `spell_one` checks (or a hit, whose range was), or
        `checked_ids`'s int64 ids."""
        if (type(src_ids) is np.ndarray and src_ids.ndim == 1 and src_ids.size and not self.identity
                and (src_ids.dtype == np.int64 or src_ids.dtype == np.int32)):
            return src_ids
        return checked_ids(self.src, src_ids)

    def _checked(self, src_ids, logprobs, mask) -> Checked:
        """As a call checks them: ids whose range the batch's spelling checks (`_ids`), log-probs as given
        when they are already plain floats."""
        ids = self._ids(src_ids)
        lp = _logprobs(logprobs, len(ids))
        msk = None if mask is None else checked_mask(mask, len(ids))
        return ids, lp, msk

    def _count_rejected(self, exc: BridgeError) -> None:
        self.stats.rejected += 1
        self.stats.undecodable += isinstance(exc, UndecodableTextError)

    def _count(self, aligned: Aligned, hit: bool) -> None:
        self.stats.bridged += 1
        self.stats.cache_hits += hit
        n_chars = int(aligned.span.groups.chars[-1])
        self.stats.chars += n_chars
        self.stats.residual_chars += aligned.span.residual * n_chars

    # -- alignment (cached) ---------------------------------------------------------------------

    def _lookup(self, ids: np.ndarray) -> Aligned | None:
        if not self.cache_size:
            return None
        key = _key(ids)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
        return cached

    def _store(self, ids: np.ndarray, aligned: Aligned) -> None:
        if self.cache_size:
            self._cache[_key(ids)] = aligned
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _aligned_one(self, ids: np.ndarray, spelled: SpelledOne | None) -> Aligned:
        """A fresh alignment of one completion (raises), stored in the cache."""
        if self.identity:
            aligned = identity(self.src, ids)
        else:
            aligned = align_one(self.src, self.dst, self._encoders, ids, spelled, self.dst_eos_id)
        self._store(ids, aligned)
        return aligned

    def _aligned(self, batch: list[np.ndarray]) -> list[Aligned | BridgeError]:
        """Fresh alignments (no cache), stored in the cache."""
        if not batch:
            return []
        if self.identity:
            results: list[Aligned | BridgeError] = [identity(self.src, ids) for ids in batch]
        else:
            results = retokenize_many(self.src, self.dst, self._encoders, batch, self.dst_eos_id)
        for ids, result in zip(batch, results):
            if not isinstance(result, BridgeError):
                self._store(ids, result)
        return results

    def _aligned_all(self, batch: dict[int, np.ndarray]) -> dict[int, tuple[Aligned | BridgeError, bool]]:
        """Cached or fresh alignment of each completion, and whether it was a cache hit. A sequence that
        repeats inside the batch is aligned once and counted as a hit after the first, as in calls."""
        out: dict[int, tuple[Aligned | BridgeError, bool]] = {}
        first_of: dict[bytes, int] = {}
        repeats: list[tuple[int, int]] = []
        misses: list[int] = []
        for k, ids in batch.items():
            cached = self._lookup(ids)
            if cached is not None:
                out[k] = (cached, True)
            elif self.cache_size and first_of.setdefault(ids.tobytes(), k) != k:
                repeats.append((k, first_of[ids.tobytes()]))
            else:
                misses.append(k)
        for k, result in zip(misses, self._aligned([batch[k] for k in misses])):
            out[k] = (result, False)
        for k, first in repeats:
            result = out[first][0]
            out[k] = (result, not isinstance(result, BridgeError))  # a failed sequence is not cached
        return out

    # -- per-call log-probs and masks -------------------------------------------------------------

    def _spread(self, aligned: Aligned, lp: np.ndarray | None, msk: np.ndarray | None) -> BridgedCompletion:
        span = aligned.span
        n_groups = len(aligned.n_dst_per_group)
        dst_lp = dst_mask = None
        if lp is not None:
            if lp.dtype != np.float64 and lp.dtype != np.float32:
                lp = lp.astype(np.float64)  # as np.bincount would read them
            # a NaN or infinite log-prob, or finite ones that overflow together, make their group sum non-finite
            bad, dst_lp, dst_mask = fastalign.spread(span.src_group, span.dst_group, aligned.n_dst_per_group, lp)
            if bad >= 0:
                group_sum = np.bincount(span.src_group, weights=lp, minlength=n_groups)  # the kernel's sums, again
                raise nonfinite_logprobs(lp, group_sum, span.groups.src)
        if msk is None:
            if dst_mask is None:
                dst_mask = np.empty(len(aligned.dst_ids), dtype=bool)
                dst_mask.fill(True)  # np.ones is a Python-level wrapper: twice the cost at these lengths
        else:
            masked_out = np.bincount(span.src_group[~msk], minlength=n_groups)
            dst_mask = (masked_out == 0)[span.dst_group]
        return BridgedCompletion(
            text=aligned.text,
            dst_ids=aligned.dst_ids,
            dst_logprobs=dst_lp,
            dst_mask=dst_mask,
            dst_group=span.dst_group,
            src_group=span.src_group,
            groups=span.groups,
            residual=span.residual,
            eos=aligned.eos,
            identity=self.identity,
        )


def _logprobs(logprobs, n: int) -> np.ndarray | None:
    """`checked_logprobs`, skipped for log-probs that are already what it would make of them."""
    if logprobs is None or _plain_floats(logprobs, n):
        return logprobs
    return checked_logprobs(logprobs, n)


def _plain_floats(logprobs, n: int) -> bool:
    """Whether log-probs are already what `checked_logprobs` would make of them: a float32/64 array of shape (n,)."""
    return (type(logprobs) is np.ndarray and logprobs.shape == (n,)
            and (logprobs.dtype == np.float32 or logprobs.dtype == np.float64))


def _key(ids: np.ndarray) -> bytes:
    """The cache key of validated ids: their int64 bytes, whatever integer type they came in."""
    return (ids if ids.dtype == np.int64 else ids.astype(np.int64)).tobytes()


def _per_completion(name: str, values: Sequence | None, n: int) -> Sequence:
    if values is None:
        return [None] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} completions; pass one per completion, or None")
    return values
