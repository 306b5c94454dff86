"""One optimizer step of a learner group: each rank's share of the prompts, gradients summed, the same update.

Every rank computes the loss on ``prompts[rank::world]``: its share's numerator over the whole
step's denominators (``step_totals``: each normalising site's count, e.g. the step's token
count for a token mean, all-reduced as one vector before any forward). The ranks' losses add
up to the loss of the whole batch on one process, so the summed gradient is its gradient, to
float rounding, for every objective and aggregation (scaling a share's own mean by its share of
the prompts is exact only where every share has the same weight in every denominator). All
ranks then clip and step identically, and hold identical weights and AdamW state.

The ``obj/*`` loss figures of a rank (``loss``, ``pg_loss``, ``kl``, ``sgt_nll``) are its
contribution to the step's loss: they add up over the ranks to the whole batch's. Counts
(``tokens``, ``rescue_set_size``, ...) and means (``clip_frac``, ...) are its share's own.
"""

from __future__ import annotations

import time

import torch

from engine.train import group as dp
from engine.train.batching import PeerSample, build_batch
from policies.denominators import SITES, given_totals, local_counts
from policies.objectives import PeerNeed, compute_loss, select_peers


def peers_for(need: PeerNeed, own: list, peers: list[PeerSample]) -> list[PeerSample]:
    """What of a step's peer samples the objective reads; "rewards" ships the scalars only."""
    chosen = select_peers(need, own, peers)
    return [p.scalars_only() for p in chosen] if need == "rewards" else chosen


def learning_rate(base: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then ``base``."""
    return base * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else base


def step_totals(state: dp.TrainState, data: dp.StepData, own, peers, pieces: list[list[int]], world: int,
                objective, pad_id: int):
    """``ObjectiveBatch.totals`` for this rank's ``pieces`` of the step: the denominators over every piece of every rank.

    Each rank counts its pieces on batches without a forward (``policies.denominators``) and
    the group adds the counts with one all-reduce, which every rank joins (an empty share adds
    zeros): no collective runs inside the objective, so no rank can skip one.
    """
    counts = torch.zeros(len(SITES), dtype=torch.float64)
    for piece in (p for p in pieces if p):
        mine = set(piece)
        own_p, peers_p = [s for s in own if s.prompt_id in mine], [p for p in peers if p.prompt_id in mine]
        counts += local_counts(build_batch(None, own_p, peers_p, piece, state.version, pad_id, data.peer_version,
                                           reference=state.reference),
                               objective, state.rng)
    return given_totals(dp.allreduce_counts(counts) if world > 1 else counts)


def train_share(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                pad_id: int, grad_clip: float, lr: float) -> dict:
    """This rank's part of one data-parallel step; every rank of the group must call it (an empty share too).

    Returns its figures (``obj/*`` from its share: see the module doc)."""
    started = time.time()
    share = data.prompts[rank::world]
    mine = set(share)
    own_r = [s for s in own if s.prompt_id in mine]
    peers_r = [p for p in peers if p.prompt_id in mine]
    stats: dict = {}
    state.optimizer.zero_grad(set_to_none=True)
    totals = step_totals(state, data, own_r, peers_r, [share], world, objective, pad_id) if world > 1 else None
    if share:
        batch = build_batch(state.model, own_r, peers_r, share, state.version, pad_id, data.peer_version,
                            reference=state.reference)  # ref_logp when objective.kl_coef > 0
        batch.totals = totals  # None on one rank: the batch is the whole step's, divided by its own counts
        loss, stats = compute_loss(batch, objective, state.rng)
        loss.backward()
    if world > 1:
        dp.allreduce_grads(state.params)
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    state.optimizer.step()
    state.version += 1
    return {"busy_s": time.time() - started, "share_samples": len(own_r), "grad_norm": float(grad_norm),
            **{f"obj/{k}": float(v) for k, v in stats.items()}}
