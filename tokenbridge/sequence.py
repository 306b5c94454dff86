"""The receiver's full training sequence: its own prompt ids + the bridged completion.

Only the completion crosses the bridge; the receiver formats the prompt with its own chat template
and passes the resulting ids here. Alignment rule: the three returned arrays share one length,
len(prompt_ids) + len(bridged.dst_ids); prompt positions are out of the loss (mask False, log-prob 0).
"""

from __future__ import annotations

import numpy as np

from tokenbridge.bridge import BridgedCompletion
from tokenbridge.errors import InvalidTokenIdError


def build_learner_sequence(
    prompt_ids, bridged: BridgedCompletion
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(input_ids (T,) int64, loss_mask (T,) bool, behaviour_logprobs (T,) float64 or None), T = P + n_dst."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or (prompt.size and prompt.dtype.kind not in "iu"):
        raise InvalidTokenIdError(
            f"prompt_ids must be a 1-D sequence of integer ids, got shape {prompt.shape}, dtype {prompt.dtype}"
        )
    if prompt.size and prompt.min() < 0:
        raise InvalidTokenIdError(f"prompt_ids[{int(np.argmin(prompt))}] is negative")
    n_prompt = len(prompt)
    input_ids = np.concatenate([prompt.astype(np.int64, copy=False), bridged.dst_ids])
    loss_mask = np.concatenate([np.zeros(n_prompt, dtype=bool), bridged.dst_mask])
    behaviour = None
    if bridged.dst_logprobs is not None:
        behaviour = np.concatenate([np.zeros(n_prompt, dtype=np.float64), bridged.dst_logprobs])
    return input_ids, loss_mask, behaviour
