"""HACPO (Heterogeneous-Agent Collaborative Policy Optimization, arXiv 2603.02604) as an objective.

Read in its released code, the verl recipe ``recipe/hacpo/`` of github.com/zzx-peter/HACRL-code (branch
``verl-v1``); the paper's own equations were not at hand here, only its abstract and section list (the code's
docstrings cite its equations (5)-(6), (56)-(57) and (59)). Piece by piece, where each follows:

- **capability** (``hacpo_core_algos.py``: ``CapabilityTracker.update``, ``.capabilities``, ``.ratio``): a model's
  P is its share of responses with reward > 0 in a step, averaged over its last ``capability_window`` steps, this
  step included, floored at 1e-8; the **discrepancy coefficient** is c = clip(P_peer / P_own, capability_min,
  capability_max): a stronger peer's samples count more, a weaker one's less. Here the engine keeps the window
  over whole steps (``engine/train/capability.py``) and hands the P's to the batch.
- **capability-aware advantage** (``compute_hacpo_advantages``): per prompt, over own and peer samples together,
  the baseline mu = (1/n) sum_i w_i r_i with w = 1 for an own sample and 1 / c for a peer's (so E[w r] is the
  receiver's own success rate); a group whose rewards are all equal has A = 0; mu > 1 falls back to the mean of
  the own rewards; the scale is the unweighted, unbiased std of the group's rewards: A = (r - mu) / (std + adv_eps).
- **own samples** (``compute_hacpo_loss``, its self branch): GSPO's sequence ratio s = exp(mean_t (log pi -
  log pi_prox)), obj = min(s A, clip(s, 1 - eps_low, 1 + eps_high) A), clip 3e-4 / 4e-4.
- **peer samples, exponential importance sampling** (its cross branch, ``sequence_mean_log_prob``):
  s = exp(clamp(mean over the receiver's tokens of its log pi - mean over the source's tokens of the source's
  log-probs, +-max_abs_log_ratio)), then obj = s_c * sg(s_c) ** alpha * c * A: the gradient is
  s_c ** (1 + alpha) c A grad mean log pi, so a peer sample the receiver finds unlikely is damped polynomially.
- **stepwise clipping** (``HacpoLossConfig.cross_clip_lower``, ``MinibatchUpdateCounter`` in
  ``hacpo_workers.py``): s_c = clamp(s, lower, 1) with lower = min(1, 1 - delta + m step), m the optimizer
  mini-batch of the step's update. A clamp, not PPO's min: outside the bounds a peer sample has no gradient,
  whatever the sign of A (one the receiver already finds likelier than its source did, s > 1, teaches nothing).
- **loss**: -(sum of obj over own and peer rows) / rows, each ratio already a token mean (the recipe's
  seq-mean-token-mean), plus the optional KL (``kl_coef``) on own tokens.

Inferred or adapted here (the recipe is synchronous, with four mini-batches a step):
- one optimizer step per learner step: no run of mini-batches for the bound to tighten over, so m is fixed at
  ``cross_clip_index`` (2, the recipe's first peer mini-batch with its defaults, where the two mini-batches of own
  samples come first: bound 0.85).
- own samples may be stale: the sequence ratio is taken against the proximal policy (the current weights) and
  weighted by the decoupled behaviour weight (AReaL's, taken on the sequence mean of log-ratios and capped at
  ``behav_weight_cap``); a sample past ``max_staleness`` leaves the step, as in the other objectives.
- the peer's text reaches the receiver through THL's retokenization, the same re-encoding of text into the
  receiver's tokens as the recipe's; only sequence sums are read here, never THL's token alignment. The source's
  log-prob sum is THL's conserved sum of the peer generator's behaviour log-probs (the recipe recomputes them with
  the source's trainer), averaged over the source's own token count (``peer_source_len``).
- a prompt without peer samples (the recipe never has one): its group is the own samples alone, w = 1.
- With no peer sample at all the loss is GSPO with GRPO's advantages under the unbiased std (tested).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from policies.batch import ObjectiveBatch
from policies.objective_config import HACPOConfig
from policies.registry import Stats, register_objective
from policies.surrogate import Fresh, aggregate, k3_kl, within_staleness

CAPABILITY_FLOOR = 1e-8  # the recipe's floor: a model with no success in its window still divides


class HacpoAdvantages(NamedTuple):
    own: Tensor  # (B,)
    peer: Tensor  # (P,)
    guarded: int  # groups whose weighted baseline passed 1 and fell back to the own mean


def _share_positive(rewards: Tensor, keep: Tensor) -> float:
    kept = rewards[keep]
    return max(float((kept > 0).float().mean()), CAPABILITY_FLOOR) if kept.numel() else 1.0


def discrepancy(batch: ObjectiveBatch, config: HACPOConfig, keep: Tensor, peer_keep: Tensor) -> Tensor:
    """(P,) c = clip(P_source / P_receiver, capability_min, capability_max) of each peer row (1 for none)."""
    own = batch.own_capability if batch.own_capability is not None else _share_positive(batch.rewards, keep)
    if batch.peer_capability is not None:
        peer = batch.peer_capability.to(torch.float64)
    else:
        peer = torch.full((batch.num_peers,), _share_positive(batch.peer_rewards, peer_keep), dtype=torch.float64)
    peer = peer.clamp(min=CAPABILITY_FLOOR).to(batch.peer_rewards.device)
    return (peer / max(own, CAPABILITY_FLOOR)).clamp(config.capability_min, config.capability_max)


def hacpo_advantages(batch: ObjectiveBatch, config: HACPOConfig, keep: Tensor, peer_keep: Tensor,
                     c: Tensor) -> HacpoAdvantages:
    """Each row's A from its prompt's own and peer rewards: capability-weighted mean, unweighted unbiased std."""
    B, Q = batch.num_own, batch.num_groups
    dev = batch.rewards.device
    r = torch.cat([batch.rewards, batch.peer_rewards]).to(torch.float64)
    g = torch.cat([batch.group, batch.peer_group])
    k = torch.cat([keep, peer_keep]).to(torch.float64)
    w = torch.cat([torch.ones(B, dtype=torch.float64, device=dev), 1.0 / c.to(torch.float64)])
    own = torch.cat([torch.ones(B, dtype=torch.float64, device=dev), torch.zeros_like(c, dtype=torch.float64)])

    def per_group(values: Tensor) -> Tensor:
        return torch.zeros(Q, dtype=torch.float64, device=dev).index_add_(0, g, values * k)

    n, own_n = per_group(torch.ones_like(r)), per_group(own)
    total, own_total, squares = per_group(r), per_group(r * own), per_group(r * r)
    mu = per_group(w * r) / n.clamp(min=1.0)
    guard = mu > 1.0  # the recipe's binary_baseline_guard: a baseline above every reward falls back to the own mean
    fallback = torch.where(own_n > 0, own_total / own_n.clamp(min=1.0), total / n.clamp(min=1.0))
    mu = torch.where(guard, fallback, mu)
    mean = total / n.clamp(min=1.0)
    var = ((squares - n * mean * mean) / (n - 1.0).clamp(min=1.0)).clamp(min=0.0)  # unbiased, as torch.std
    big = torch.finfo(torch.float64).max
    kept_r = torch.where(k > 0, r, torch.full_like(r, big))
    low = torch.full((Q,), big, dtype=torch.float64, device=dev).scatter_reduce(0, g, kept_r, "amin")
    high = torch.full((Q,), -big, dtype=torch.float64, device=dev).scatter_reduce(
        0, g, torch.where(k > 0, r, torch.full_like(r, -big)), "amax")
    uniform = low >= high  # all rewards equal (or one sample): no signal, A = 0
    centred = r - mu[g]
    adv = centred / (var.sqrt()[g] + config.adv_eps) if config.std_normalise else centred
    adv = torch.where(uniform[g] | (k == 0), torch.zeros_like(adv), adv).to(batch.rewards.dtype)
    return HacpoAdvantages(adv[:B], adv[B:], int((guard & (n > 0)).sum()))


def _seq_mean(values: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum(dim=1) / lengths.clamp(min=1.0)


def cross_log_ratio(recv_logp: Tensor, source_logp: Tensor, mask: Tensor, source_len: Tensor, bound: float) -> Tensor:
    """(P,) log of HACPO's re-encoded ratio: the receiver's mean log-prob over its own tokens minus the source's
    over the source's ``source_len`` tokens (``source_logp``: THL's aligned copy, whose sum is the source's),
    clamped to +-``bound``."""
    return (_seq_mean(recv_logp, mask, mask.sum(dim=1))
            - _seq_mean(source_logp.detach(), mask, source_len.to(mask.dtype))).clamp(-bound, bound)


@register_objective("hacpo", HACPOConfig, peers="samples")
def hacpo_objective(*, batch: ObjectiveBatch, config: HACPOConfig, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """HACPO: GSPO on own samples, the capability-weighted, clipped exponential cross ratio on every peer's."""
    fresh = within_staleness(batch.mask, batch.staleness, config.max_staleness)
    peer = within_staleness(batch.peer_mask, batch.peer_staleness, config.max_staleness)
    own_len, peer_len = fresh.mask.sum(dim=1), peer.mask.sum(dim=1)
    own_rows, peer_rows = fresh.keep & (own_len > 0), peer.keep & (peer_len > 0)
    c = discrepancy(batch, config, fresh.keep, peer.keep)
    adv = hacpo_advantages(batch, config, fresh.keep, peer.keep, c)
    bound = config.max_abs_log_ratio

    # own: GSPO's sequence ratio against the proximal policy, times the (detached) behaviour weight
    prox = batch.prox_logp if batch.prox_logp is not None else batch.logp.detach()
    log_s = _seq_mean(batch.logp - prox.detach(), fresh.mask, own_len).clamp(-bound, bound)
    s = log_s.exp()
    log_iw = _seq_mean((prox - batch.behav_logp).detach(), fresh.mask, own_len)
    iw_truncated = log_iw > math.log(config.behav_weight_cap)
    iw = log_iw.clamp(max=bound).exp().clamp(max=config.behav_weight_cap)
    a_own = adv.own.detach()
    own_obj = iw * torch.minimum(s * a_own, s.clamp(1.0 - config.eps_low, 1.0 + config.eps_high) * a_own)

    # peers: the receiver's per-token mean over its tokens against the source's over the source's own tokens
    source_len = batch.peer_source_len if batch.peer_source_len is not None else peer_len
    log_x = cross_log_ratio(batch.peer_logp, batch.peer_behav_logp, peer.mask, source_len, bound)
    lower = config.cross_clip_lower
    x = log_x.exp()
    x_c = x.clamp(lower, 1.0)  # a clamp: outside [lower, 1] the peer row has no gradient
    peer_obj = x_c * x_c.detach() ** config.alpha * c.to(x_c.dtype) * adv.peer.detach()

    numerator = torch.where(own_rows, own_obj, torch.zeros_like(own_obj)).sum() \
        + torch.where(peer_rows, peer_obj, torch.zeros_like(peer_obj)).sum()
    rows = batch.total("rows", torch.as_tensor(float(own_rows.sum() + peer_rows.sum()), dtype=numerator.dtype))
    pg = -numerator / rows.clamp(min=1.0)
    kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    if config.kl_coef > 0.0:
        if batch.ref_logp is None:
            raise ValueError("objective config kl_coef > 0 needs batch.ref_logp (reference log-probs); set kl_coef = 0 or pass them")
        kl = aggregate([(k3_kl(batch.logp, batch.ref_logp, fresh.mask), fresh.mask)], "seq_mean",
                       partial(batch.total, "kl"))
    loss = pg + config.kl_coef * kl
    return loss, _stats(batch, config, fresh, peer, own_rows, peer_rows, s, iw, iw_truncated, a_own, adv, x, c, pg, kl, loss)


def _mean(values: Tensor, where: Tensor) -> float:
    return float(values.detach()[where].float().mean()) if bool(where.any()) else 0.0


def _stats(batch: ObjectiveBatch, config: HACPOConfig, fresh: Fresh, peer: Fresh, own_rows: Tensor, peer_rows: Tensor, s: Tensor,
           iw: Tensor, iw_truncated: Tensor, a_own: Tensor, adv: HacpoAdvantages, x: Tensor, c: Tensor, pg: Tensor,
           kl: Tensor, loss: Tensor) -> Stats:
    s = s.detach()
    low = (s < 1.0 - config.eps_low) & (a_own < 0)
    high = (s > 1.0 + config.eps_high) & (a_own > 0)
    x = x.detach()
    own_adv = a_own[fresh.keep].float()
    return {
        "loss": float(loss.detach()), "pg_loss": float(pg.detach()), "kl": float(kl.detach()),
        "clip_frac": _mean((low | high).float(), own_rows), "clip_low_frac": _mean(low.float(), own_rows),
        "clip_high_frac": _mean(high.float(), own_rows), "ratio_mean": _mean(s, own_rows),
        "iw_mean": _mean(iw, own_rows), "iw_max": float(iw.detach()[own_rows].max()) if bool(own_rows.any()) else 0.0,
        "iw_truncated_frac": _mean(iw_truncated.float(), own_rows), "staleness_dropped": float(fresh.dropped),
        "adv_mean": float(own_adv.mean()) if own_adv.numel() else 0.0,
        "adv_std": float(own_adv.std(unbiased=False)) if own_adv.numel() else 0.0,
        "tokens": float(fresh.mask.sum()),
        # what crossed: the peers' sequence ratio, how many sat outside the clip (no gradient), their weight
        "cross_ratio_mean": _mean(x, peer_rows),
        "cross_clipped_frac": _mean(((x < config.cross_clip_lower) | (x > 1.0)).float(), peer_rows),
        "discrepancy_mean": _mean(c, peer_rows),
        "peer_adv_mean": _mean(adv.peer, peer_rows),
        "peer_rows": float(peer_rows.sum()),
        "peer_tokens": float((batch.peer_mask * peer_rows[:, None].to(batch.peer_mask.dtype)).sum()),
        "baseline_guarded_groups": float(adv.guarded),
        "peer_staleness_dropped": float(peer.dropped),
    }
