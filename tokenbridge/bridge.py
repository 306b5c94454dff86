"""The bridge: a source model's completion ids (+ behaviour log-probs, mask) -> the destination's terms.

Rules, in the order they apply:

- Only the completion crosses; it must be non-empty, its ids inside the source vocabulary, and
  log-probs / mask (if given) one per id, log-probs finite. Anything else is a `BridgeError`.
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
  group sum is conserved (float64). Masks: a destination token is in the loss only if EVERY source
  token of its group was (a group is never half-trained).
- Same tokenizer (same serialized fingerprint): identity, ids passed through untouched (a
  non-canonical tokenization the generator sampled stays as sampled), residual 0.
- Results of a given source id sequence are cached (LRU): the alignment does not depend on the
  log-probs, which are re-spread per call. Id and group arrays are read-only (shared with the cache).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np
from transformers import PreTrainedTokenizerFast

from tokenbridge.align import Groups
from tokenbridge.errors import (
    BridgeError,
    EmptyCompletionError,
    InvalidLogprobError,
    InvalidTokenIdError,
    LengthMismatchError,
    NonFiniteLogprobError,
    UndecodableTextError,
    UnsupportedTokenizerError,
)
from tokenbridge.profile import profile_of
from tokenbridge.retokenize import Aligned, identity, private_encoder, retokenize


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
        self._encoder = None if self.identity else private_encoder(dst_tokenizer.backend_tokenizer, self.dst)

    def __call__(self, src_ids, logprobs=None, mask=None) -> BridgedCompletion:
        """Bridge one completion: src_ids (n,) ints; logprobs (n,) floats or None; mask (n,) bools or None."""
        try:
            ids, lp, msk = self._validated(src_ids, logprobs, mask)
            aligned, hit = self._aligned(ids)
        except BridgeError as exc:
            self.stats.rejected += 1
            self.stats.undecodable += isinstance(exc, UndecodableTextError)
            raise
        self.stats.bridged += 1
        self.stats.cache_hits += hit
        n_chars = int(aligned.span.groups.chars[-1])
        self.stats.chars += n_chars
        self.stats.residual_chars += aligned.span.residual * n_chars
        return self._spread(aligned, lp, msk)

    # -- input checks ---------------------------------------------------------------------------

    def _validated(self, src_ids, logprobs, mask) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        ids = np.asarray(src_ids)
        if ids.ndim != 1:
            raise InvalidTokenIdError(f"src_ids must be a 1-D sequence of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise EmptyCompletionError("src_ids is empty: there is no completion to bridge")
        if ids.dtype.kind not in "iu":
            raise InvalidTokenIdError(f"src_ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        # one reduction checks both ends: viewed as unsigned, negative ids are huge
        too_big = int(ids.view(np.uint64).max()) >= self.src.vocab_size
        if too_big or (self.src.has_holes and not self.src.valid[ids].all()):
            bad = (ids < 0) | (ids >= self.src.vocab_size)
            bad |= ~self.src.valid[np.clip(ids, 0, self.src.vocab_size - 1)]
            pos = int(np.argmax(bad))
            raise InvalidTokenIdError(
                f"src_ids[{pos}] = {int(ids[pos])} is outside the source vocabulary (size {self.src.vocab_size})"
            )
        lp = None
        if logprobs is not None:
            try:
                lp = np.asarray(logprobs, dtype=np.float64)
            except (TypeError, ValueError):
                raise InvalidLogprobError("logprobs must be a 1-D sequence of numbers, one per source token") from None
            if lp.shape != ids.shape:
                raise LengthMismatchError(f"logprobs has shape {lp.shape} but src_ids has {ids.shape}")
            finite = np.isfinite(lp)
            if not finite.all():
                pos = int(np.argmin(finite))
                raise NonFiniteLogprobError(f"logprobs[{pos}] is {lp[pos]}; behaviour log-probs must be finite")
        msk = None
        if mask is not None:
            msk = np.asarray(mask)
            if msk.shape != ids.shape:
                raise LengthMismatchError(f"mask has shape {msk.shape} but src_ids has {ids.shape}")
            if msk.dtype.kind not in "biuf":
                raise LengthMismatchError(f"mask must hold booleans (or 0/1), got dtype {msk.dtype}")
            msk = msk.astype(bool, copy=False)
        return ids, lp, msk

    # -- alignment (cached) ---------------------------------------------------------------------

    def _aligned(self, ids: np.ndarray) -> tuple[Aligned, bool]:
        key = ids.tobytes()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached, True
        if self.identity:
            aligned = identity(self.src, ids)
        else:
            aligned = retokenize(self.src, self.dst, self._encoder, ids, self.dst_eos_id)
        if self.cache_size:
            self._cache[key] = aligned
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return aligned, False

    # -- per-call log-probs and masks -------------------------------------------------------------

    def _spread(self, aligned: Aligned, lp: np.ndarray | None, msk: np.ndarray | None) -> BridgedCompletion:
        span = aligned.span
        n_groups = len(span.groups)
        dst_lp = None
        if lp is not None:
            group_sum = np.bincount(span.src_group, weights=lp, minlength=n_groups)
            dst_lp = (group_sum / aligned.n_dst_per_group)[span.dst_group]
        if msk is None:
            dst_mask = np.ones(len(aligned.dst_ids), dtype=bool)
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
