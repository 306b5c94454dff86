"""Token log-probabilities of given sequences, computing the vocabulary softmax sparsely.

``pack`` right-pads prompt+completion sequences and remembers where each completion sits,
so ``completion_logprobs`` returns log-probs aligned to completion tokens: row i, column j
is completion token j of sequence i (the forward runs on the model's device).

The samples of a group share their prompt: ``completion_logprobs`` runs each distinct prompt
once and the completions on its key/value cache, so a prompt several times longer than its
completions (a chat template's) is not paid once per sample, in the forward nor in the backward.

On CPU the (positions x vocabulary) projection and log-softmax dominate a tiny model's
step (50k-entry vocabularies against width 128), so they are computed only at the
positions whose log-prob is wanted, not at every position as `model(...).logits` does.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from policies.chunked_head import BLOCK_BYTES, chunkable_head, chunked_head_logprobs


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
    picked = head_logprobs(model, hidden[:, :-1][predicts], input_ids[:, 1:][predicts])  # (N,)
    out = torch.zeros(B, L - 1, dtype=picked.dtype, device=picked.device)
    out = out.masked_scatter(predicts, picked)  # fills in row-major order, as [predicts] read
    return F.pad(out, (1, 0))  # (B, L)


def head_logprobs(model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[n]) from the hidden state that predicts it, (N, D) and (N,) -> (N,): the LM head and a
    float32 log-softmax at those N positions only. Where (N, V) float32 logits would pass one block
    (``policies.chunked_head``), a plain linear head runs a block of rows at a time, forward and backward, so
    a large vocabulary's logits are never held whole. A family that caps its logits (Gemma 2's
    ``final_logit_softcapping``) has them capped here as its forward caps them in generation."""
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if not cap and chunkable_head(head) and hidden.shape[0] * head.weight.shape[0] * 4 > BLOCK_BYTES:
        return chunked_head_logprobs(head, hidden, targets)
    logits = head(hidden).float()  # (N, V)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24 on, ``past_key_values``
    before. An older forward takes the new name into ``**kwargs`` and drops it without a word, so asking
    the signature is the only safe way: a cache passed under the wrong name stays empty."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    if name not in params:
        raise TypeError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=")
    return name


@dataclass
class Packed:
    input_ids: torch.Tensor  # (N, L) long, right-padded
    attention_mask: torch.Tensor  # (N, L) long
    target_mask: torch.Tensor  # (N, L) bool: completion positions
    gather_index: torch.Tensor  # (N, T) long: position of completion token j in row i (clamped)
    comp_mask: torch.Tensor  # (N, T) float: 1 where completion token j exists
    prompt_len: torch.Tensor  # (N,) long: row i's prompt tokens
    prompt_of: torch.Tensor  # (N,) long: which distinct prompt row i's is (numbered as first seen)

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
    distinct: dict[bytes, int] = {}
    prompt_of = [distinct.setdefault(np.asarray(p, dtype=np.int64).tobytes(), len(distinct)) for p in prompts]
    return Packed(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        target_mask=torch.from_numpy(target),
        gather_index=torch.from_numpy(gather),
        comp_mask=torch.from_numpy(comp_mask.astype(np.float32)),
        prompt_len=torch.from_numpy(p_len),
        prompt_of=torch.tensor(prompt_of, dtype=torch.long),
    )


def completion_logprobs(model, packed: Packed) -> torch.Tensor:
    """(N, T) log-probs of completion tokens under ``model`` (differentiable); 0 on padding.

    Rows without a completion token (none, or peers' reward-only samples) run no forward."""
    if not has_completion_tokens(packed):
        return torch.zeros_like(packed.comp_mask)
    packed = packed.to(model_device(model))  # the forward runs where the weights are
    if shares_prompts(packed) and can_share_prompts(model):
        return shared_prompt_logprobs(model, packed)
    full = token_logprobs(model, packed.input_ids, packed.attention_mask, packed.target_mask)  # (N, L)
    return full.gather(1, packed.gather_index) * packed.comp_mask


def shares_prompts(packed: Packed) -> bool:
    """Whether some prompt of ``packed`` is that of several rows (a group's samples)."""
    return len(packed.prompt_of) > 0 and int(packed.prompt_of.max()) + 1 < len(packed.prompt_of)


def can_share_prompts(model: torch.nn.Module) -> bool:
    """A sharded model runs one forward per call on every rank (its all-gathers must pair up across ranks),
    and gradient checkpointing turns the KV cache off: both take the one-forward path."""
    return not hasattr(model, "sharded_token_logprobs") and not _checkpointing(model)


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on: the property's name since transformers 5.x, or before."""
    name = next((n for n in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), n)), None)
    return bool(getattr(model, name)) if name else False


def shared_prompt_logprobs(model: PreTrainedModel, packed: Packed) -> torch.Tensor:
    """``completion_logprobs`` with each distinct prompt run once: (N, T), differentiable.

    The prompts' forward keeps its key/value cache; the cache is indexed out to one row per sample (an
    index, so the gradient of every row flows back into its prompt's forward) and the completions run on
    it, at the positions they hold in the whole sequence. The same log-probs as one forward over every
    prompt+completion, up to float rounding; the prompt's share of the work is paid once per group."""
    N, T = packed.comp_mask.shape
    rows = torch.arange(N, device=packed.prompt_of.device)
    U = int(packed.prompt_of.max()) + 1
    first = torch.full((U,), N, dtype=torch.long, device=rows.device).scatter_reduce(0, packed.prompt_of, rows, "amin")
    prompt_len = packed.prompt_len
    P = int(prompt_len.max())
    prompt_mask = (torch.arange(P, device=rows.device)[None, :] < prompt_len[first][:, None]).long()  # (U, P)
    base = model.base_model
    out = base(input_ids=packed.input_ids[first, :P], attention_mask=prompt_mask,
               position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")  # its name before transformers 5.24
    cache.batch_select_indices(packed.prompt_of)  # (N, ...): row i reads its prompt's keys and values
    comp_ids = packed.input_ids.gather(1, packed.gather_index)  # (N, T): completion token j of row i
    comp_attn = packed.comp_mask.long()
    h_comp = base(input_ids=comp_ids, attention_mask=torch.cat([prompt_mask[packed.prompt_of], comp_attn], dim=1),
                  position_ids=prompt_len[:, None] + torch.arange(T, device=rows.device)[None, :],
                  **{cache_argument(base): cache}, use_cache=True).last_hidden_state  # (N, T, D)
    h_last = out.last_hidden_state[packed.prompt_of, prompt_len - 1]  # (N, D): the prompt's end predicts token 0
    h_pred = torch.cat([h_last[:, None], h_comp[:, :-1]], dim=1)  # (N, T, D): what predicts token j
    want = packed.comp_mask.bool()
    picked = head_logprobs(model, h_pred[want], comp_ids[want])
    return torch.zeros(N, T, dtype=picked.dtype, device=picked.device).masked_scatter(want, picked)


def has_completion_tokens(packed: Packed) -> bool:
    """Whether ``completion_logprobs`` runs a forward on ``packed`` (a sharded step counts them)."""
    return bool(packed.target_mask.any())


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live (its first parameter's device)."""
    return next(model.parameters()).device
