"""The four objectives: GRPO (solo), XGRPO (value level), PRP (data level), SGT (outcome level).

Each is a pure function of an ``ObjectiveBatch`` registered under its config's ``kind``;
``compute_loss(batch, config, rng)`` dispatches. Formulas as implemented are written out
in policies/OBJECTIVES.md. Shared pieces live in ``advantages`` (group statistics) and
``surrogate`` (token-level decoupled PPO).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from policies.advantages import grpo_advantages, group_moments, pooled_advantages
from policies.batch import ObjectiveBatch
from policies.objective_config import (
    GRPOConfig,
    HACPOConfig,
    ObjectiveConfig,
    PRPConfig,
    SGTConfig,
    SGTRefConfig,
    SurrogateConfig,
    XGRPOConfig,
)
from policies.registry import (Objective, PeerNeed, Stats, compute_loss, get_objective, objective_names, peer_need,
                               register_objective)
from policies.surrogate import (
    Fresh,
    aggregate,
    behaviour_weight,
    capped_weight,
    clipped_surrogate,
    k3_kl,
    masked_log_diff,
    masked_mean,
    within_staleness,
)

__all__ = [
    "ObjectiveBatch", "ObjectiveConfig", "GRPOConfig", "XGRPOConfig", "PRPConfig", "SGTConfig", "SGTRefConfig",
    "HACPOConfig",
    "Objective", "PeerNeed", "compute_loss", "register_objective", "get_objective", "objective_names", "peer_need",
    "select_peers",
    "grpo_objective", "xgrpo_objective", "prp_objective", "sgt_objective", "prp_weights",
]


class OwnTerm(NamedTuple):
    pg: Tensor  # scalar policy-gradient loss over own tokens only
    kl: Tensor  # scalar aggregated k3 KL (0 when kl_coef == 0)
    token_loss: Tensor  # (B, T) per-token surrogate, for pooling with peer tokens
    stats: Stats


def _own_term(batch: ObjectiveBatch, config: SurrogateConfig, adv: Tensor, fresh: Fresh) -> OwnTerm:
    """Decoupled clipped surrogate on the receiver's own (fresh) tokens, plus its stats."""
    mask = fresh.mask
    prox = batch.prox_logp if batch.prox_logp is not None else batch.logp.detach()
    iw, truncated = behaviour_weight(prox, batch.behav_logp, mask, config.behav_weight_cap)
    tok = clipped_surrogate(batch.logp, prox, adv, iw, mask, config.eps_low, config.eps_high)
    pg = aggregate([(tok.loss, mask)], config.aggregation, partial(batch.total, "own"))
    kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    if config.kl_coef > 0.0:
        if batch.ref_logp is None:
            raise ValueError("objective config kl_coef > 0 needs batch.ref_logp (reference log-probs); set kl_coef = 0 or pass them")
        kl = aggregate([(k3_kl(batch.logp, batch.ref_logp, mask), mask)], config.aggregation, partial(batch.total, "kl"))
    kept_adv = adv.detach()[fresh.keep].float()
    stats = {
        "clip_frac": masked_mean(tok.clipped.float(), mask),
        # the region's two sides, as TRL logs them: a ratio below 1 - eps_low where the advantage is negative,
        # above 1 + eps_high where it is positive (their union is clip_frac)
        "clip_low_frac": masked_mean(((tok.ratio < 1.0 - config.eps_low) & (adv.detach()[:, None] < 0)).float(), mask),
        "clip_high_frac": masked_mean(((tok.ratio > 1.0 + config.eps_high) & (adv.detach()[:, None] > 0)).float(),
                                      mask),
        "ratio_mean": masked_mean(tok.ratio, mask),
        "iw_mean": masked_mean(iw, mask),
        "iw_max": float(iw.detach()[mask > 0].max()) if bool((mask > 0).any()) else 0.0,
        "iw_truncated_frac": masked_mean(truncated.float(), mask),
        "staleness_dropped": float(fresh.dropped),
        "adv_mean": float(kept_adv.mean()) if kept_adv.numel() else 0.0,
        "adv_std": float(kept_adv.std(unbiased=False)) if kept_adv.numel() else 0.0,
        "tokens": float(mask.sum()),
        "kl": float(kl.detach()),
    }
    return OwnTerm(pg, kl, tok.loss, stats)


def _finish(pg: Tensor, kl: Tensor, config: SurrogateConfig, stats: Stats) -> tuple[Tensor, Stats]:
    loss = pg + config.kl_coef * kl
    stats["pg_loss"] = float(pg.detach())
    stats["loss"] = float(loss.detach())
    return loss, stats


@register_objective("grpo", GRPOConfig)
def grpo_objective(*, batch: ObjectiveBatch, config: SurrogateConfig, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """Solo GRPO: A_i from the receiver's own fresh rewards in group g_i; peers are ignored."""
    fresh = within_staleness(batch.mask, batch.staleness, config.max_staleness)
    adv = grpo_advantages(
        batch.rewards, batch.group, fresh.keep, batch.num_groups, config.std_normalise, config.adv_eps
    ).own
    term = _own_term(batch, config, adv, fresh)
    return _finish(term.pg, term.kl, config, term.stats)


@register_objective("xgrpo", XGRPOConfig, peers="rewards")
def xgrpo_objective(*, batch: ObjectiveBatch, config: XGRPOConfig, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """XGRPO: own tokens only; baseline/scale of group g over own + peer rewards on g (peer scalars only)."""
    fresh = within_staleness(batch.mask, batch.staleness, config.max_staleness)
    peer = within_staleness(batch.peer_mask, batch.peer_staleness, config.max_staleness)
    adv = pooled_advantages(
        batch.rewards, batch.group, fresh.keep, batch.peer_rewards, batch.peer_group, peer.keep,
        batch.num_groups, config.std_normalise, config.adv_eps, leave_own_out=config.leave_own_out,
    )
    term = _own_term(batch, config, adv.own, fresh)
    stats = term.stats
    has_own = adv.own_moments.count > 0
    peer_count = group_moments(batch.peer_rewards, batch.peer_group, peer.keep, batch.num_groups).count
    both = has_own & (peer_count > 0)
    stats.update(
        baseline_mean=_mean_where(adv.baseline, has_own),
        own_baseline_mean=_mean_where(adv.own_moments.mean, has_own),
        baseline_shift_mean=_mean_where(adv.baseline - adv.own_moments.mean, both),
        scale_mean=_mean_where(adv.scale, has_own),
        peer_reward_groups=float(both.sum()),
        # groups with no fresh peer reward: the baseline fell back to the own rewards alone
        baseline_fallback_groups=float((has_own & (peer_count == 0)).sum()),
        baseline_fallback_frac=_mean_where((peer_count == 0).to(adv.scale.dtype), has_own),
        peer_staleness_dropped=float(peer.dropped),
    )
    return _finish(term.pg, term.kl, config, stats)


def prp_weights(
    recv_logp: Tensor, peer_behav_logp: Tensor, mask: Tensor, align: Tensor, variant: str, cap: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated density ratio w = min(pi_receiver / pi_peer, cap) for bridged peer samples.

    Returns (w per token (P, T2) detached, w per unit, truncated per unit): a unit is a
    peer sample with >= 1 token for "sequence" / "length_norm", and a masked token for
    "token" (whose weight is that of its THL aligned group).
    """
    P, T2 = mask.shape
    log_r = masked_log_diff(recv_logp.detach(), peer_behav_logp.detach(), mask)  # (P, T2), capped after the sum
    lengths = mask.sum(dim=1)
    if variant == "sequence":
        log_w = log_r.sum(dim=1, keepdim=True).expand(P, T2)
    elif variant == "length_norm":
        log_w = (log_r.sum(dim=1) / lengths.clamp(min=1.0))[:, None].expand(P, T2)
    elif variant == "token":
        valid = (align >= 0) & (mask > 0)
        slot = align.clamp(min=0) + torch.arange(P, device=align.device)[:, None] * T2  # (P, T2) flat group id
        sums = torch.zeros(P * T2, dtype=log_r.dtype, device=log_r.device)
        sums.index_add_(0, slot.reshape(-1), torch.where(valid, log_r, torch.zeros_like(log_r)).reshape(-1))
        log_w = sums[slot]
    else:
        raise ValueError(f"PRP variant must be 'sequence', 'length_norm' or 'token', got {variant!r}")
    weight, truncated = capped_weight(log_w, cap)
    if variant == "token":
        keep = mask > 0
        return weight, weight[keep], truncated[keep]
    if T2 == 0:
        return weight, weight.new_zeros(0), torch.zeros(0, dtype=torch.bool, device=weight.device)
    rows = lengths > 0
    return weight, weight[:, 0][rows], truncated[:, 0][rows]


@register_objective("prp", PRPConfig, peers="samples")
def prp_objective(*, batch: ObjectiveBatch, config: PRPConfig, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """PRP: peer samples join the receiver's group; pooled advantages; peer tokens weighted by w."""
    fresh = within_staleness(batch.mask, batch.staleness, config.max_staleness)
    peer = within_staleness(batch.peer_mask, batch.peer_staleness, config.max_staleness)
    adv = pooled_advantages(
        batch.rewards, batch.group, fresh.keep, batch.peer_rewards, batch.peer_group, peer.keep,
        batch.num_groups, config.std_normalise, config.adv_eps,
    )
    term = _own_term(batch, config, adv.own, fresh)
    w, unit_w, unit_truncated = prp_weights(
        batch.peer_logp, batch.peer_behav_logp, peer.mask, batch.peer_align, config.variant, config.ratio_cap
    )
    # pi_peer generated these tokens: the proximal anchor is the receiver's current policy (rho = 1 in value,
    # gradient A * w * grad log pi), and w is the only off-policy correction.
    peer_tok = clipped_surrogate(
        batch.peer_logp, batch.peer_logp.detach(), adv.peer, w, peer.mask, config.eps_low, config.eps_high
    )
    pg = aggregate([(term.token_loss, fresh.mask), (peer_tok.loss, peer.mask)], config.aggregation,
                   partial(batch.total, "pooled"))
    stats = term.stats
    kept_peer_adv = adv.peer.detach()[peer.keep].float()
    stats.update(
        w_mean=float(unit_w.mean()) if unit_w.numel() else 0.0,
        w_var=float(unit_w.var(unbiased=False)) if unit_w.numel() else 0.0,
        w_max=float(unit_w.max()) if unit_w.numel() else 0.0,
        w_truncated_frac=float(unit_truncated.float().mean()) if unit_truncated.numel() else 0.0,
        peer_residual_mean=float(batch.peer_residual.detach()[peer.keep].float().mean()) if bool(peer.keep.any()) else 0.0,
        peer_adv_mean=float(kept_peer_adv.mean()) if kept_peer_adv.numel() else 0.0,
        peer_tokens=float(peer.mask.sum()),
        peer_staleness_dropped=float(peer.dropped),
    )
    return _finish(pg, term.kl, config, stats)


@register_objective("sgt_ref", SGTRefConfig, peers="reference")
@register_objective("sgt", SGTConfig, peers="rescue")
def sgt_objective(*, batch: ObjectiveBatch, config: SGTConfig, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """SGT: GRPO(own) + lambda * mean over rescue groups of NLL(one uniformly drawn verified peer success).

    ``sgt_ref`` is the same loss; the engine fills the peer slots with the task's reference solutions."""
    loss, stats = grpo_objective(batch=batch, config=config, rng=rng)
    fresh = within_staleness(batch.mask, batch.staleness, config.max_staleness)
    peer = within_staleness(batch.peer_mask, batch.peer_staleness, config.max_staleness)
    Q = batch.num_groups
    own = group_moments(batch.verified.float(), batch.group, fresh.keep, Q)  # mean = success rate
    own_failed = (own.count > 0) & (own.mean == 0)  # (Q,) every fresh own sample failed
    lengths = peer.mask.sum(dim=1)
    eligible = batch.peer_verified & peer.keep & (lengths > 0) & own_failed[batch.peer_group]
    chosen = pick_one_per_group(eligible, batch.peer_group, Q, rng, batch.peer_draw)  # (P,) bool, <= 1 per group
    token_nll = -torch.where(peer.mask > 0, batch.peer_logp, torch.zeros_like(batch.peer_logp)) * peer.mask
    nll = token_nll.sum(dim=1)
    if config.nll_norm == "token_mean":
        nll = nll / lengths.clamp(min=1.0)  # the row's own length: the same on any share of the batch
    rescued = chosen.sum()  # = groups with an eligible row, whichever row the draw picks
    per_group = batch.total("rescued", rescued).clamp(min=1).to(nll.dtype)  # the whole step's rescue set
    sgt_term = torch.where(chosen, nll, torch.zeros_like(nll)).sum() / per_group
    loss = loss + config.lam * sgt_term
    stats.update(
        rescue_set_size=float(rescued),
        own_failed_groups=float(own_failed.sum()),
        sgt_nll=float(sgt_term.detach()),
        loss=float(loss.detach()),
        peer_staleness_dropped=float(peer.dropped),
    )
    return loss, stats


def pick_one_per_group(eligible: Tensor, group: Tensor, num_groups: int, rng: torch.Generator,
                       keys: Tensor | None = None) -> Tensor:
    """Uniformly choose one eligible row per group: (P,) bool with exactly one True per group that has any.

    The row with the largest key wins: ``keys`` (``ObjectiveBatch.peer_draw``, distinct within a group)
    or, without them, a permutation drawn from ``rng``."""
    P = eligible.shape[0]
    if keys is None:
        keys = torch.randperm(P, generator=rng, device=rng.device).to(eligible.device)  # distinct: no ties
    keys = keys.to(eligible.device)
    keys = torch.where(eligible, keys, torch.full_like(keys, -1))
    best = torch.full((num_groups,), -1, dtype=keys.dtype, device=keys.device)
    best = best.scatter_reduce(0, group, keys, reduce="amax", include_self=True)
    return eligible & (keys == best[group])


def _mean_where(values: Tensor, where: Tensor) -> float:
    return float(values[where].mean()) if bool(where.any()) else 0.0


def select_peers(need: PeerNeed, own: list, peers: list) -> list:
    """The peer samples an objective with ``need`` reads, from a step's ``peers``.

    Samples are anything with ``prompt_id`` and ``verified`` (own) / ``verified`` (peers);
    "rewards" keeps every sample, whose tokens the caller may drop (only the reward is read).
    """
    if need == "none":
        return []
    if need in ("rescue", "reference"):  # only a verified success on a prompt where every own sample failed can matter
        failed = {s.prompt_id for s in own} - {s.prompt_id for s in own if s.verified}
        return [p for p in peers if p.verified and p.prompt_id in failed]
    return list(peers)
