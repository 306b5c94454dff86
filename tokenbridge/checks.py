"""Input checks of a bridge call: source ids, behaviour log-probs and loss mask of one completion.

Each failure is a `BridgeError` subclass whose one-sentence message names the field and position.
"""

from __future__ import annotations

import numpy as np

from tokenbridge.errors import (
    EmptyCompletionError,
    InvalidLogprobError,
    InvalidMaskError,
    InvalidTokenIdError,
    LengthMismatchError,
    NonFiniteLogprobError,
)
from tokenbridge.profile import VocabProfile


def checked_ids(profile: VocabProfile, src_ids) -> np.ndarray:
    """(n,) int64 ids, non-empty and inside the vocabulary."""
    given = np.asarray(src_ids)
    if given.ndim != 1:
        raise InvalidTokenIdError(f"src_ids must be a 1-D sequence of token ids, got shape {given.shape}")
    if given.size == 0:
        raise EmptyCompletionError("src_ids is empty: there is no completion to bridge")
    if given.dtype.kind not in "iu":
        raise InvalidTokenIdError(f"src_ids must be integers, got dtype {given.dtype}")
    ids = given.astype(np.int64, copy=False)
    # one reduction checks both ends: viewed as unsigned, negative ids (and uint64 ids >= 2**63) are huge
    too_big = int(ids.view(np.uint64).max()) >= profile.vocab_size
    if too_big or (profile.has_holes and not profile.valid[ids].all()):
        bad = (ids < 0) | (ids >= profile.vocab_size)
        bad |= ~profile.valid[np.clip(ids, 0, profile.vocab_size - 1)]
        pos = int(np.argmax(bad))
        raise InvalidTokenIdError(  # the given value: a uint64 id >= 2**63 is not the int64 it wraps to
            f"src_ids[{pos}] = {int(given[pos])} is outside the source vocabulary (size {profile.vocab_size})"
        )
    return ids


def checked_logprobs(logprobs, n: int) -> np.ndarray:
    """(n,) real log-probs, float32 or float64 as given (bincount sums them in float64 either way).

    Their finiteness is checked where they are summed, per aligned group (`nonfinite_logprobs`): a NaN
    or an infinity makes its group's sum non-finite, so one check covers both (and costs one call)."""
    lp = np.asarray(logprobs)
    if lp.dtype.kind not in "fiub":
        try:
            lp = np.asarray(logprobs, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidLogprobError("logprobs must be a 1-D sequence of numbers, one per source token") from None
    if lp.shape != (n,):
        raise LengthMismatchError(f"logprobs has shape {lp.shape} but src_ids has {(n,)}")
    return lp


def nonfinite_logprobs(lp: np.ndarray, group_sum: np.ndarray, src_bounds: np.ndarray) -> NonFiniteLogprobError:
    """The error for log-probs whose aligned-group sums are not all finite: the first NaN or infinite
    log-prob, else the first group whose finite log-probs sum beyond float64."""
    finite = np.isfinite(lp)
    if not finite.all():
        pos = int(np.argmin(finite))
        return NonFiniteLogprobError(f"logprobs[{pos}] is {lp[pos]}; behaviour log-probs must be finite")
    g = int(np.argmin(np.isfinite(group_sum)))
    a, b = int(src_bounds[g]), int(src_bounds[g + 1])
    return NonFiniteLogprobError(
        f"logprobs[{a}:{b}] sum to {group_sum[g]} in aligned group {g}; each group's behaviour log-probs must have a"
        " finite float64 sum"
    )


def checked_mask(mask, n: int) -> np.ndarray:
    """(n,) bool mask from booleans or the numbers 0 and 1; NaN, 2, 0.5 or text are refused, not read as True."""
    given = np.asarray(mask)
    if given.shape != (n,):
        raise LengthMismatchError(f"mask has shape {given.shape} but src_ids has {(n,)}")
    if given.dtype == np.bool_:
        return given
    if given.dtype.kind not in "iuf":
        raise InvalidMaskError(f"mask must hold booleans (or 0/1), got dtype {given.dtype}")
    ones = given == 1
    valid = ones | (given == 0)
    if not valid.all():
        pos = int(np.argmin(valid))
        raise InvalidMaskError(f"mask[{pos}] is {given[pos]}; a loss mask holds booleans or 0/1")
    return ones
