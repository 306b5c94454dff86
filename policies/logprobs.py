"""Token log-probabilities of given sequences, computing the vocabulary softmax sparsely.

``pack`` right-pads prompt+completion sequences and remembers where each completion sits,
so ``completion_logprobs`` returns log-probs aligned to completion tokens: row i, column j
is completion token j of sequence i (the forward runs on the model's device).

On CPU the (positions x vocabulary) projection and log-softmax dominate a tiny model's
step (50k-entry vocabularies against width 128), so they are computed only at the
positions whose log-prob is wanted, not at every position as `model(...).logits` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
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
    sharded: bool = True,
) -> torch.Tensor:
    """log p(input_ids[b, t] | input_ids[b, :t]) where target_mask[b, t], else 0. Shape (B, L).

    Differentiable. The LM head and log-softmax run only at the N target positions
    (an (N, V) matrix instead of (B, L, V)). Position 0 has no prefix and cannot be a
    target. Float32 log-softmax whatever the model dtype. A model sharded by
    engine.train.sharding is entered through its FSDP-hooked method (which calls back here).
    """
    if sharded and hasattr(model, "sharded_token_logprobs"):
        return model.sharded_token_logprobs(input_ids, attention_mask, target_mask)
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


@dataclass
class Packed:
    input_ids: torch.Tensor  # (N, L) long, right-padded
    attention_mask: torch.Tensor  # (N, L) long
    target_mask: torch.Tensor  # (N, L) bool: completion positions
    gather_index: torch.Tensor  # (N, T) long: position of completion token j in row i (clamped)
    comp_mask: torch.Tensor  # (N, T) float: 1 where completion token j exists

    def to(self, device: torch.device | str) -> Packed:
        """The same packing on ``device`` (tensors already there are reused, not copied)."""
        return Packed(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def pack(prompts: list[np.ndarray], completions: list[np.ndarray], pad_id: int) -> Packed:
    N = len(prompts)
    p_len = np.array([len(p) for p in prompts], dtype=np.int64)
    c_len = np.array([len(c) for c in completions], dtype=np.int64)
    L = int((p_len + c_len).max()) if N else 1
    T = max(int(c_len.max()) if N else 0, 1)
    ids = np.full((N, L), pad_id, dtype=np.int64)
    attn = np.zeros((N, L), dtype=np.int64)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # N rows, not tokens: cheap
        n = len(p) + len(c)
        ids[i, : len(p)] = p
        ids[i, len(p) : n] = c
        attn[i, :n] = 1
    cols = np.arange(T)[None, :]
    comp_mask = cols < c_len[:, None]
    gather = np.where(comp_mask, p_len[:, None] + cols, 0)
    target = np.zeros((N, L), dtype=bool)
    rows = np.repeat(np.arange(N), c_len)
    target[rows, gather[comp_mask]] = True
    return Packed(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        target_mask=torch.from_numpy(target),
        gather_index=torch.from_numpy(gather),
        comp_mask=torch.from_numpy(comp_mask.astype(np.float32)),
    )


def completion_logprobs(model, packed: Packed) -> torch.Tensor:
    """(N, T) log-probs of completion tokens under ``model`` (differentiable); 0 on padding.

    Rows without a completion token (none, or peers' reward-only samples) run no forward."""
    if not has_completion_tokens(packed):
        return torch.zeros_like(packed.comp_mask)
    packed = packed.to(model_device(model))  # the forward runs where the weights are
    full = token_logprobs(model, packed.input_ids, packed.attention_mask, packed.target_mask)  # (N, L)
    return full.gather(1, packed.gather_index) * packed.comp_mask


def has_completion_tokens(packed: Packed) -> bool:
    """Whether ``completion_logprobs`` runs a forward on ``packed`` (a sharded step counts them)."""
    return bool(packed.target_mask.any())


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live (its first parameter's device)."""
    return next(model.parameters()).device
