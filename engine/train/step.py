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
from policies.chunked_head import dense_grads, grads_into_params, sparse_input_embedding
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
    for piece in pieces:
        if not piece:  # an empty share: nothing to run, it still joins the all-reduce below
            continue
        mine = set(piece)
        own_p, peers_p = [s for s in own if s.prompt_id in mine], [p for p in peers if p.prompt_id in mine]
        counts += local_counts(build_batch(None, own_p, peers_p, piece, state.version, pad_id, data.peer_version,
                                           reference=state.reference),
                               objective, state.rng)
    return given_totals(dp.allreduce_counts(counts) if world > 1 else counts)


def micro_batches(share: list[int], accum: int) -> list[list[int]]:
    """``share`` cut into ``accum`` consecutive pieces (as even as can be; some may be empty)."""
    size, extra = divmod(len(share), accum)
    out, start = [], 0
    for i in range(accum):
        end = start + size + (i < extra)
        out.append(share[start:end])
        start = end
    return out


# Piece figures that add up to the step's: its loss terms (each piece's numerator over the step's denominators)
# and counts; a figure named *_max is the largest piece's; any other is a mean, weighted by the piece's samples.
_ADDED = ("loss", "pg_loss", "kl", "sgt_nll", "tokens", "peer_tokens", "peer_rows")
_ADDED_SUFFIXES = ("_dropped", "_groups", "_size")


def merge_stats(pieces: list[tuple[dict, int]]) -> dict:
    """One step's objective figures from its micro-batches' ``(stats, samples)``."""
    pieces = [(stats, n) for stats, n in pieces if stats]
    if len(pieces) <= 1:
        return pieces[0][0] if pieces else {}
    weight = sum(n for _, n in pieces) or 1
    out: dict = {}
    for key in pieces[0][0]:
        values = [(float(stats[key]), n) for stats, n in pieces if key in stats]
        if key in _ADDED or key.endswith(_ADDED_SUFFIXES):
            out[key] = sum(v for v, _ in values)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v * n for v, n in values) / weight
    return out


def train_share(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                pad_id: int, grad_clip: float, lr: float, accum: int = 1) -> dict:
    """This rank's part of one data-parallel step; every rank of the group must call it (an empty share too).

    ``accum`` > 1 runs the share as that many micro-batches, one forward and backward each, gradients added
    before the one update: a step's activations are held a piece at a time (``train.grad_accum``). Each piece's
    loss is its numerator over the whole step's denominators, so the pieces add up to the one-batch loss.
    Returns its figures (``obj/*`` from its share: see the module doc)."""
    started = time.time()
    share = data.prompts[rank::world]
    pieces = [p for p in micro_batches(share, accum) if p] or [[]]
    state.optimizer.zero_grad(set_to_none=True)
    # one piece on one rank divides by its own counts (None); otherwise every piece by the step's
    totals = step_totals(state, data, own, peers, pieces, world, objective, pad_id) \
        if world > 1 or len(pieces) > 1 else None
    # HACPO's capabilities: from the whole step (every rank has it), so every piece reads the same
    capability = state.capability.update(own, peers) if state.capability is not None else None
    done, samples = [], 0
    sparse = sparse_input_embedding(state.model)
    for piece in (p for p in pieces if p):
        mine = set(piece)
        own_p = [s for s in own if s.prompt_id in mine]
        batch = build_batch(state.model, own_p, [p for p in peers if p.prompt_id in mine], piece, state.version,
                            pad_id, data.peer_version, reference=state.reference,  # ref_logp when kl_coef > 0
                            capability=capability)
        batch.totals = totals
        loss, stats = compute_loss(batch, objective, state.rng)
        dense_grads(sparse)
        with grads_into_params():  # the vocabulary's gradients added into .grad, not held twice (chunked_head)
            loss.backward()
        done.append((stats, len(own_p)))
        samples += len(own_p)
    if world > 1:
        dp.allreduce_grads(state.params)
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    state.optimizer.step()
    state.version += 1
    return {"busy_s": time.time() - started, "share_samples": samples, "grad_norm": float(grad_norm),
            **{f"obj/{k}": float(v) for k, v in merge_stats(done).items()}}
