"""Group statistics and group-relative advantages, vectorised over prompt groups.

Everything here is a scatter over a ``group`` index (no Python loop over samples).
Statistics are computed in float64 so that a group of equal rewards has a standard
deviation of exactly zero and its advantages are exactly zero.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupMoments(NamedTuple):
    count: Tensor  # (Q,) float64, summed weights (0 for an empty group)
    mean: Tensor  # (Q,) float64, 0 for an empty group
    std: Tensor  # (Q,) float64, population std (ddof=0), 0 for groups of <= 1 sample


def group_moments(values: Tensor, group: Tensor, weight: Tensor, num_groups: int) -> GroupMoments:
    """Weighted count, mean and population std of ``values`` (N,) per group id in ``group`` (N,).

    ``weight`` (N,) is 0/1 membership (e.g. not stale); weight-0 entries do not count.
    """
    values64 = values.detach().to(torch.float64)
    weight64 = weight.detach().to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, group, weight64)
    total = torch.zeros_like(count).index_add_(0, group, weight64 * values64)
    mean = total / count.clamp(min=1.0)
    centred = values64 - mean[group]
    sq = torch.zeros_like(count).index_add_(0, group, weight64 * centred * centred)
    std = (sq / count.clamp(min=1.0)).sqrt()
    return GroupMoments(count, mean, std)


def concat_moments(
    values: tuple[Tensor, ...], groups: tuple[Tensor, ...], weights: tuple[Tensor, ...], num_groups: int
) -> GroupMoments:
    """Moments over several sample sets pooled per group (own + peer rewards on the same prompt)."""
    return group_moments(torch.cat(values), torch.cat(groups), torch.cat(weights), num_groups)


def relative_advantages(
    rewards: Tensor, group: Tensor, baseline: Tensor, scale: Tensor, std_normalise: bool, eps: float
) -> Tensor:
    """A_i = (r_i - b[g_i]) / (s[g_i] + eps) if std_normalise else r_i - b[g_i]; returned in rewards' dtype.

    ``baseline`` and ``scale`` are (Q,) float64 per-group tensors; a zero-spread group
    therefore gets advantage 0 / eps = 0, never NaN.
    """
    centred = rewards.detach().to(torch.float64) - baseline[group]
    if std_normalise:
        centred = centred / (scale[group] + eps)
    return centred.to(rewards.dtype)


class Advantages(NamedTuple):
    own: Tensor  # (B,) advantage of each own sample
    peer: Tensor  # (P,) advantage of each peer sample (zeros when peers only inform the baseline)
    baseline: Tensor  # (Q,) float64 baseline used per group
    scale: Tensor  # (Q,) float64 scale used per group
    own_moments: GroupMoments  # own-only statistics, for reporting the baseline shift


def grpo_advantages(
    rewards: Tensor, group: Tensor, keep: Tensor, num_groups: int, std_normalise: bool, eps: float
) -> Advantages:
    """Solo GRPO: baseline and scale over the receiver's own kept rewards in each group."""
    own = group_moments(rewards, group, keep, num_groups)
    adv = relative_advantages(rewards, group, own.mean, own.std, std_normalise, eps)
    return Advantages(adv, rewards.new_zeros(0), own.mean, own.std, own)


def pooled_advantages(
    rewards: Tensor,
    group: Tensor,
    keep: Tensor,
    peer_rewards: Tensor,
    peer_group: Tensor,
    peer_keep: Tensor,
    num_groups: int,
    std_normalise: bool,
    eps: float,
    leave_own_out: bool = False,
) -> Advantages:
    """Baseline and scale over own + peer rewards on the same prompt (XGRPO, PRP).

    leave_own_out: the baseline is the peers' mean reward where a group has peer rewards
    (own mean where it has none); the scale stays pooled so one peer sample cannot make
    it zero.
    """
    own = group_moments(rewards, group, keep, num_groups)
    pooled = concat_moments((rewards, peer_rewards), (group, peer_group), (keep, peer_keep), num_groups)
    baseline = pooled.mean
    if leave_own_out:
        peers = group_moments(peer_rewards, peer_group, peer_keep, num_groups)
        baseline = torch.where(peers.count > 0, peers.mean, own.mean)
    adv = relative_advantages(rewards, group, baseline, pooled.std, std_normalise, eps)
    peer_adv = relative_advantages(peer_rewards, peer_group, baseline, pooled.std, std_normalise, eps)
    return Advantages(adv, peer_adv, baseline, pooled.std, own)
