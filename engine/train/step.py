"""One optimizer step of a learner group: each rank's share of the prompts, gradients summed, the same update.

Every rank computes the loss on ``prompts[rank::world]`` scaled by its share of the
prompts, so the summed gradient equals the gradient of the whole batch's loss; all
ranks then clip and step identically, and hold identical weights and AdamW state.
"""

from __future__ import annotations

import time

import torch

from engine.train import group as dp
from engine.train.batching import PeerSample, build_batch
from policies.objectives import PeerNeed, compute_loss, select_peers


def peers_for(need: PeerNeed, own: list, peers: list[PeerSample]) -> list[PeerSample]:
    """What of a step's peer samples the objective reads; "rewards" ships the scalars only."""
    chosen = select_peers(need, own, peers)
    return [p.scalars_only() for p in chosen] if need == "rewards" else chosen


def learning_rate(base: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then ``base``."""
    return base * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else base


def train_share(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                pad_id: int, grad_clip: float, lr: float) -> dict:
    """This rank's part of one data-parallel step; returns its figures (``obj/*`` from its share)."""
    started = time.time()
    share = data.prompts[rank::world]
    mine = set(share)
    own_r = [s for s in own if s.prompt_id in mine]
    peers_r = [p for p in peers if p.prompt_id in mine]
    stats: dict = {}
    state.optimizer.zero_grad(set_to_none=True)
    if share:
        batch = build_batch(state.model, own_r, peers_r, share, state.version, pad_id, data.peer_version)
        batch = batch.to(next(state.model.parameters()).device)  # built on CPU; the loss runs where the weights are
        loss, stats = compute_loss(batch, objective, state.rng)
        (loss * len(share) / len(data.prompts)).backward()
    if world > 1:
        dp.allreduce_grads(state.params)
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    state.optimizer.step()
    state.version += 1
    return {"busy_s": time.time() - started, "share_samples": len(own_r), "grad_norm": float(grad_norm),
            **{f"obj/{k}": float(v) for k, v in stats.items()}}
