"""Turn experience into the tensors an objective reads (``build_batch``: own and bridged peer samples).

The batch is built on CPU; the forward that gives the log-probs runs on the model's device
(``policies.logprobs.completion_logprobs``), and ``ObjectiveBatch.to`` moves the rest there.
"""

from __future__ import annotations

import collections
import hashlib

import msgspec
import numpy as np
import torch

from engine.train.capability import Capability
from engine.train.reference import Reference
from policies.batch import ObjectiveBatch
from policies.logprobs import Packed, completion_logprobs, model_device, pack


def pad_rows(rows: list[np.ndarray], width: int, fill: float, dtype) -> torch.Tensor:
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def forward_count(own: list[OwnSample], peers: list[PeerSample]) -> int:
    """How many forwards ``build_batch`` runs with a model: one per side with a completion token."""
    return sum(any(len(s.completion_ids) for s in side) for side in (own, peers))


def _logprobs(model, packed: Packed) -> torch.Tensor:
    return torch.zeros_like(packed.comp_mask) if model is None else completion_logprobs(model, packed)


class OwnSample(msgspec.Struct, array_like=True):
    """One of the receiver's own completions (arrays travel between ranks through ``ARRAY_HOOKS``)."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    reward: float
    verified: bool
    weight_version: int
    prompt_id: int
    reward_parts: list[float] = []  # each reward function's reward (NaN: abstained), with [reward] funcs set
    finished: bool = True  # it ended on an end token (False: cut at train.max_new_tokens)


class PeerSample(msgspec.Struct, array_like=True):
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
    source_tokens: int = 0  # its length in the source's own tokens (HACPO averages the source's log-probs over them)

    def scalars_only(self) -> PeerSample:
        """The same sample without its tokens: for objectives that read only the reward."""
        empty = np.zeros(0, dtype=np.int64)
        return msgspec.structs.replace(self, prompt_ids=self.prompt_ids[:1], completion_ids=empty, align=empty,
                                       behaviour_logprobs=np.zeros(0, dtype=np.float32))


def build_batch(
    model,
    own: list[OwnSample],
    peers: list[PeerSample],
    prompt_order: list[int],
    learner_version: int,
    pad_id: int,
    peer_version: dict[str, int] | None = None,
    reference: Reference | None = None,
    capability: Capability | None = None,
) -> ObjectiveBatch:
    """The ObjectiveBatch of one learner step, on ``model``'s device (every path that trains, the sharded one
    too, takes it from here); group index = position of the prompt in ``prompt_order``.

    ``reference`` (``objective.kl_coef > 0``) gives ``ref_logp``: its log-probs of the own samples, from one
    forward shaped as the policy's. ``model`` None runs no forward: log-probs (the reference's too) are
    zeros, a CPU batch for counting denominators only (``policies.denominators.local_counts``). ``capability``
    (HACPO's, from ``engine.train.capability``) gives each model's capability to the batch."""
    batch = _host_batch(model, own, peers, prompt_order, learner_version, pad_id, peer_version, reference)
    if capability is not None:
        batch.own_capability = capability.own
        batch.peer_capability = torch.tensor([capability.peers.get(p.model, 1.0) for p in peers], dtype=torch.float32)
    return batch if model is None else batch.to(model_device(model))


def _host_batch(model, own: list[OwnSample], peers: list[PeerSample], prompt_order: list[int], learner_version: int,
                pad_id: int, peer_version: dict[str, int] | None, reference: Reference | None) -> ObjectiveBatch:
    """build_batch's fields: the log-probs where the model is, the rest built on the host."""
    index = {pid: g for g, pid in enumerate(prompt_order)}
    packed = pack([s.prompt_ids for s in own], [s.completion_ids for s in own], pad_id)
    logp = _logprobs(model, packed)
    # a counting batch (no model) stands zeros in for the reference: the KL site's denominator counts masks
    ref_logp = None if reference is None else torch.zeros_like(logp) if model is None else reference.logprobs(packed)
    T = logp.shape[1]
    behav = pad_rows([s.behaviour_logprobs for s in own], T, 0.0, np.float32)
    fields = dict(
        logp=logp,
        behav_logp=behav,
        prox_logp=None,  # one optimizer step per batch: the proximal policy is the current one
        ref_logp=ref_logp,
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
    plogp = _logprobs(model, ppacked)
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
        peer_draw=draw_keys(peers, learner_version),
        peer_source_len=torch.tensor([p.source_tokens or len(p.completion_ids) for p in peers], dtype=torch.long),
    )


def draw_keys(peers: list[PeerSample], step: int) -> torch.Tensor:
    """``ObjectiveBatch.peer_draw``: each row's key hashes the step, its prompt and its place among that prompt's
    peers (the low 16 bits: distinct within a prompt), so every split of the step's prompts draws alike."""
    places: collections.Counter = collections.Counter()
    keys = []
    for p in peers:
        place = places[p.prompt_id]
        places[p.prompt_id] += 1
        digest = hashlib.blake2b(f"{step}/{p.prompt_id}/{place}".encode(), digest_size=8).digest()
        keys.append((int.from_bytes(digest, "little") >> 17 << 16) | min(place, 0xFFFF))
    return torch.tensor(keys, dtype=torch.long)
