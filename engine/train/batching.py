"""Turn experience into the tensors an objective reads.

``pack`` right-pads prompt+completion sequences and remembers where each
completion sits, so ``completion_logprobs`` can return log-probs aligned to
completion tokens: row i, column j is completion token j of sequence i.

Devices: ``pack`` and ``build_batch`` build on CPU; ``completion_logprobs`` runs the
forward on the model's device (it moves the packed tensors there), and ``batch_to``
moves a whole ObjectiveBatch to the model's device before the objective reads it.
On CPU both moves hand back the very same tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from policies.batch import ObjectiveBatch
from policies.logprobs import token_logprobs


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
    """(N, T) log-probs of completion tokens under ``model`` (differentiable); 0 on padding."""
    if packed.input_ids.shape[0] == 0:
        return torch.zeros(0, packed.comp_mask.shape[1])
    packed = packed.to(model_device(model))  # the forward runs where the weights are
    full = token_logprobs(model, packed.input_ids, packed.attention_mask, packed.target_mask)  # (N, L)
    return full.gather(1, packed.gather_index) * packed.comp_mask


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live (its first parameter's device)."""
    return next(model.parameters()).device


def batch_to(batch: ObjectiveBatch, device: torch.device | str) -> ObjectiveBatch:
    """``batch`` with every tensor field on ``device``; None and int fields as they are.

    ``Tensor.to`` is differentiable and returns the tensor itself when it is already on
    ``device``, so log-probs keep their graph and a CPU batch moved to CPU is unchanged.
    """
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v.to(device) for k, v in values.items() if isinstance(v, torch.Tensor)})


def pad_rows(rows: list[np.ndarray], width: int, fill: float, dtype) -> torch.Tensor:
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


@dataclass
class OwnSample:
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    reward: float
    verified: bool
    weight_version: int
    prompt_id: int


@dataclass
class PeerSample:
    """A peer's completion, already bridged into the receiver's tokens."""

    model: str
    prompt_id: int
    prompt_ids: np.ndarray  # the receiver's own template for the prompt
    completion_ids: np.ndarray  # bridged (receiver's tokens)
    behaviour_logprobs: np.ndarray  # peer's, aligned by THL
    align: np.ndarray  # THL aligned-group id per bridged token
    residual: float
    reward: float
    verified: bool
    weight_version: int

    def scalars_only(self) -> PeerSample:
        """The same sample without its tokens: for objectives that read only the reward."""
        empty = np.zeros(0, dtype=np.int64)
        return dataclasses.replace(self, prompt_ids=self.prompt_ids[:1], completion_ids=empty, align=empty,
                                   behaviour_logprobs=np.zeros(0, dtype=np.float32))


def build_batch(
    model,
    own: list[OwnSample],
    peers: list[PeerSample],
    prompt_order: list[int],
    learner_version: int,
    pad_id: int,
    peer_version: dict[str, int] | None = None,
) -> ObjectiveBatch:
    """The ObjectiveBatch of one learner step; group index = position of the prompt in ``prompt_order``."""
    index = {pid: g for g, pid in enumerate(prompt_order)}
    packed = pack([s.prompt_ids for s in own], [s.completion_ids for s in own], pad_id)
    logp = completion_logprobs(model, packed)
    T = logp.shape[1]
    behav = pad_rows([s.behaviour_logprobs for s in own], T, 0.0, np.float32)
    fields = dict(
        logp=logp,
        behav_logp=behav,
        prox_logp=None,  # one optimizer step per batch: the proximal policy is the current one
        mask=packed.comp_mask,
        rewards=torch.tensor([s.reward for s in own], dtype=torch.float32),
        group=torch.tensor([index[s.prompt_id] for s in own], dtype=torch.long),
        staleness=torch.tensor([learner_version - s.weight_version for s in own], dtype=torch.long),
        verified=torch.tensor([s.verified for s in own], dtype=torch.bool),
        num_groups=len(prompt_order),
    )
    if not peers:
        return ObjectiveBatch(**fields, **ObjectiveBatch.empty_peers(T))
    ppacked = pack([p.prompt_ids for p in peers], [p.completion_ids for p in peers], pad_id)
    plogp = completion_logprobs(model, ppacked)
    T2 = plogp.shape[1]
    versions = peer_version or {}
    return ObjectiveBatch(
        **fields,
        peer_logp=plogp,
        peer_behav_logp=pad_rows([p.behaviour_logprobs for p in peers], T2, 0.0, np.float32),
        peer_mask=ppacked.comp_mask,
        peer_rewards=torch.tensor([p.reward for p in peers], dtype=torch.float32),
        peer_group=torch.tensor([index[p.prompt_id] for p in peers], dtype=torch.long),
        peer_verified=torch.tensor([p.verified for p in peers], dtype=torch.bool),
        peer_residual=torch.tensor([p.residual for p in peers], dtype=torch.float32),
        peer_align=pad_rows([p.align for p in peers], T2, -1, np.int64),
        peer_staleness=torch.tensor(
            [max(versions.get(p.model, p.weight_version) - p.weight_version, 0) for p in peers], dtype=torch.long
        ),
    )
