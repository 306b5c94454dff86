"""Token-level pieces shared by every objective: decoupled clipped surrogate, weights, KL, aggregation.

Decoupled PPO (AReaL): the behaviour policy that generated a sample and the proximal
policy that anchors the trust region are separate. Per token

    rho   = pi_theta / pi_prox                      (gets the gradient, clipped)
    iw    = min(pi_prox / pi_behav, cap)            (detached, truncated)
    loss  = iw * max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))

Per-token log-ratios are clamped to +-LOG_RATIO_CLAMP before exp so padding garbage or a
wildly stale sample can never produce inf/NaN. A weight over a whole sequence (PRP) sums the
unclamped log-ratios first and caps the sum (``capped_weight``): clamping each token before
summing would let one very unlikely token be outvoted by a few likely ones.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, NamedTuple

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0

Aggregation = Literal["token_mean", "seq_mean"]


class TokenLoss(NamedTuple):
    loss: Tensor  # (B, T) per-token loss, not yet masked
    ratio: Tensor  # (B, T) detached pi_theta / pi_prox
    clipped: Tensor  # (B, T) bool, the clipped branch is the active one (its gradient is 0)


class Fresh(NamedTuple):
    keep: Tensor  # (N,) bool, within the staleness bound
    mask: Tensor  # (N, T) token mask with stale rows zeroed
    dropped: int  # rows masked for staleness


def within_staleness(mask: Tensor, staleness: Tensor | None, max_staleness: int) -> Fresh:
    """The rows within ``max_staleness`` (every row when ``staleness`` is None), their mask, and how many left."""
    if staleness is None:
        return Fresh(torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device), mask, 0)
    keep = staleness <= max_staleness
    return Fresh(keep, mask * keep[:, None].to(mask.dtype), int((~keep).sum()))


def masked_log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """log(num / den) on masked tokens, 0 elsewhere, clamped; gradient flows through ``num`` and ``den``."""
    diff = torch.where(mask > 0, num - den, torch.zeros_like(num))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_log_diff(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """log(num / den) on masked tokens, 0 elsewhere, not clamped (detached inputs are finite: the codec rejects inf)."""
    return torch.where(mask > 0, num - den, torch.zeros_like(num))


def capped_weight(log_w: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """min(exp(log_w), cap), exactly ``cap`` where truncated (exp(log cap) can miss it by an ulp), and where.

    With an infinite cap, log_w is still clamped at LOG_RATIO_CLAMP so the weight stays finite.
    """
    truncated = log_w > math.log(cap)
    weight = log_w.clamp(max=LOG_RATIO_CLAMP).exp()
    return torch.where(truncated, torch.full_like(weight, cap), weight), truncated


def behaviour_weight(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Detached decoupled importance weight min(pi_prox / pi_behav, cap) (B, T), and where it was truncated."""
    weight, truncated = capped_weight(masked_log_ratio(prox_logp.detach(), behav_logp.detach(), mask), cap)
    return weight, truncated & (mask > 0)


def clipped_surrogate(
    logp: Tensor, prox_logp: Tensor, adv: Tensor, weight: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> TokenLoss:
    """Per-token decoupled PPO loss; ``adv`` is (B,) per sample, ``weight`` (B, T) detached."""
    ratio = masked_log_ratio(logp, prox_logp.detach(), mask).exp()
    adv_tok = adv.detach()[:, None]
    unclipped = -adv_tok * ratio
    clipped = -adv_tok * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped) * weight.detach()
    clip_active = (clipped > unclipped) & (mask > 0)
    return TokenLoss(loss, ratio.detach(), clip_active)


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    log_r = masked_log_ratio(ref_logp.detach(), logp, mask)
    return log_r.exp() - log_r - 1.0


def aggregate(parts: list[tuple[Tensor, Tensor]], mode: Aggregation,
              total: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Reduce several (loss (R, T), mask (R, T)) blocks to one scalar, pooling all their rows.

    token_mean: sum of masked token losses / number of masked tokens (over all blocks).
    seq_mean: mean over rows with >= 1 token of each row's masked token mean.
    An all-masked input gives 0 with a finite (zero) gradient.
    ``total`` maps these blocks' denominator (tokens, or rows with a token) to the one to divide
    by: a data-parallel step gives the whole step's (``ObjectiveBatch.total``), so the ranks'
    losses add up to the whole batch's. The numerator is always these blocks' own.
    """
    total = total or (lambda count: count)
    if mode == "token_mean":
        loss = sum((torch.where(m > 0, losses, torch.zeros_like(losses)) * m).sum() for losses, m in parts)
        tokens = total(torch.as_tensor(sum(m.sum() for _, m in parts), dtype=loss.dtype))
        return loss / torch.clamp(tokens, min=1.0)
    if mode == "seq_mean":
        row_sums = [(torch.where(m > 0, losses, torch.zeros_like(losses)) * m).sum(dim=1) for losses, m in parts]
        row_lens = [m.sum(dim=1) for _, m in parts]
        means = torch.cat([s / n.clamp(min=1.0) for s, n in zip(row_sums, row_lens)])  # a row's own length: exact
        rows = total(torch.cat([(n > 0).to(means.dtype) for n in row_lens]).sum())
        return means.sum() / rows.clamp(min=1.0)
    raise ValueError(f"aggregation must be 'token_mean' or 'seq_mean', got {mode!r}")


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of ``values`` where ``mask`` > 0 as a Python float (0.0 when nothing is masked in)."""
    keep = mask > 0
    return float(values.detach()[keep].float().mean()) if bool(keep.any()) else 0.0
