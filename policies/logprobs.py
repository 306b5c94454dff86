"""Token log-probabilities of given sequences, computing the vocabulary softmax sparsely.

On CPU the (positions x vocabulary) projection and log-softmax dominate a tiny model's
step (50k-entry vocabularies against width 128), so they are computed only at the
positions whose log-prob is wanted, not at every position as `model(...).logits` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them.

    Generation (left-padded) and training (right-padded) must agree on positions for
    their log-probs to agree; HF models default to arange(L) when none are given.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hidden_states(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Final-layer (normed) hidden states, (B, L, D): everything except the LM head."""
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # (B, L) long
    attention_mask: torch.Tensor,  # (B, L), 1 = real token
    target_mask: torch.Tensor,  # (B, L) bool, True = wanted log-prob
) -> torch.Tensor:
    """log p(input_ids[b, t] | input_ids[b, :t]) where target_mask[b, t], else 0. Shape (B, L).

    Differentiable. The LM head and log-softmax run only at the N target positions
    (an (N, V) matrix instead of (B, L, V)). Position 0 has no prefix and cannot be a
    target. Float32 log-softmax whatever the model dtype.
    """
    B, L = input_ids.shape
    target_mask = target_mask.bool()
    if target_mask[:, 0].any():
        raise ValueError("target_mask[:, 0] is set, but the first token has no prefix to predict it from")
    hidden = hidden_states(model, input_ids, attention_mask)  # (B, L, D)
    predicts = target_mask[:, 1:]  # (B, L-1): hidden at t-1 predicts token t
    h = hidden[:, :-1][predicts]  # (N, D)
    targets = input_ids[:, 1:][predicts]  # (N,)
    logits = model.get_output_embeddings()(h).float()  # (N, V)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N,)
    out = torch.zeros(B, L - 1, dtype=picked.dtype, device=picked.device)
    out = out.masked_scatter(predicts, picked)  # fills in row-major order, as [predicts] read
    return F.pad(out, (1, 0))  # (B, L)
