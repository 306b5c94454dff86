"""Typed objective configs: one msgspec Struct per objective, tagged by ``kind``.

A TOML table such as ``[objective] kind = "prp"  ratio_cap = 2.0`` decodes straight into
``ObjectiveConfig`` (``msgspec.convert(table, ObjectiveConfig)``); unknown keys and bad
values are refused with a message naming the field.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec


class SurrogateConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Fields every objective shares: the decoupled clipped surrogate on the receiver's own samples."""

    eps_low: float = 0.2  # clip rho below at 1 - eps_low
    eps_high: float = 0.28  # clip rho above at 1 + eps_high (DAPO clip-higher)
    behav_weight_cap: float = 5.0  # truncate pi_prox / pi_behav here (decoupled PPO importance weight)
    max_staleness: int = 4  # samples with learner version - sample version above this are masked and counted
    std_normalise: bool = True  # A = (r - mean) / (std + eps); False -> Dr.GRPO mean-only A = r - mean
    adv_eps: float = 1e-6  # keeps zero-variance groups finite (their advantages are exactly 0)
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"  # how token losses become one scalar
    # TRL's beta: the loss adds kl_coef * k3 KL(policy || starting weights) over own tokens (obj/kl: KL per token)
    kl_coef: float = 0.0  # > 0 keeps a frozen copy of the starting weights on each learner (LoRA: base, adapters off)

    @property
    def kind(self) -> str:
        """The registry name this config selects (its msgspec tag)."""
        return str(type(self).__struct_config__.tag)

    def __post_init__(self) -> None:
        _require(0.0 <= self.eps_low < 1.0, "eps_low", self.eps_low, "must be in [0, 1)")
        _require(self.eps_high >= 0.0, "eps_high", self.eps_high, "must be >= 0")
        _require(self.behav_weight_cap >= 1.0, "behav_weight_cap", self.behav_weight_cap, "must be >= 1")
        _require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        _require(self.adv_eps > 0.0, "adv_eps", self.adv_eps, "must be > 0")
        _require(self.kl_coef >= 0.0, "kl_coef", self.kl_coef, "must be >= 0")


class GRPOConfig(SurrogateConfig, tag="grpo"):
    """Solo GRPO: own samples, own group baseline."""


class XGRPOConfig(SurrogateConfig, tag="xgrpo"):
    """Cross-model GRPO: own samples, baseline and scale pooled with peer rewards on the same prompt."""

    leave_own_out: bool = False  # baseline from peer rewards only (scale stays pooled)


class PRPConfig(SurrogateConfig, tag="prp"):
    """Peer rollout policy gradient: bridged peer samples join the group, weighted by a truncated ratio."""

    ratio_cap: float = 2.0  # c in w = min(pi_receiver / pi_peer, c)
    variant: Literal["sequence", "length_norm", "token"] = "sequence"  # where the ratio is taken

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.ratio_cap > 0.0, "ratio_cap", self.ratio_cap, "must be > 0")


class SGTConfig(SurrogateConfig, tag="sgt"):
    """Success-guided training: GRPO plus lambda * NLL of one verified peer success on the rescue set."""

    lam: float = msgspec.field(default=0.1, name="lambda")  # weight of the rescue NLL term
    nll_norm: Literal["token_mean", "sum"] = "token_mean"  # NLL per token of y* (SFT style) or summed

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.lam >= 0.0, "lambda", self.lam, "must be >= 0")


class SGTRefConfig(SGTConfig, tag="sgt_ref"):
    """The answer-key control: SGT's term with the task's reference solution in place of a peer's
    success, on the same rescue condition (every own sample of the prompt failed). On a task with
    one correct answer, SGT cannot do better than this; what it does beyond this is what peers add."""


class HACPOConfig(SurrogateConfig, tag="hacpo"):
    """HACPO (arXiv 2603.02604, its verl recipe): every peer sample joins the group; a capability-weighted
    baseline; own samples under GSPO's sequence ratio, peer samples under its exponentially weighted, stepwise
    clipped cross ratio times the capability discrepancy (policies/hacpo.py). The defaults are the recipe's: here
    eps_low / eps_high are the own ratio's clip, 3e-4 / 4e-4, and the aggregation is the sequence mean."""

    eps_low: float = 3e-4  # the own (GSPO) sequence ratio's clip, below: the recipe's self_clip_low
    eps_high: float = 4e-4  # and above: its self_clip_high
    aggregation: Literal["seq_mean"] = "seq_mean"  # the recipe requires seq-mean-token-mean
    alpha: float = 1.0  # the cross term is s_c * sg(s_c) ** alpha: gradient s_c ** (1 + alpha) * grad mean log pi
    cross_clip_delta: float = 0.2  # the cross ratio is clipped to [min(1, 1 - delta + index * step), 1]
    cross_clip_step: float = 0.025  # how far the bound moves up per mini-batch (index) of the update
    cross_clip_index: int = 2  # the optimizer mini-batch the peers' update is: the recipe's first peer one is 2
    max_abs_log_ratio: float = 10.0  # |mean log pi_target - mean log pi_source| clamped here
    capability_window: int = 5  # a model's capability: its share of rewards > 0 over its last this many steps
    capability_min: float = 0.1  # the capability ratio P_peer / P_own clipped to [min, max]
    capability_max: float = 10.0  # so a peer's samples count between a tenth and ten times

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.alpha >= 0.0, "alpha", self.alpha, "must be >= 0")
        _require(0.0 < self.cross_clip_delta <= 1.0, "cross_clip_delta", self.cross_clip_delta, "must be in (0, 1]")
        _require(self.cross_clip_step >= 0.0, "cross_clip_step", self.cross_clip_step, "must be >= 0")
        _require(self.cross_clip_index >= 0, "cross_clip_index", self.cross_clip_index, "must be >= 0")
        _require(self.max_abs_log_ratio > 0.0, "max_abs_log_ratio", self.max_abs_log_ratio, "must be > 0")
        _require(self.capability_window >= 1, "capability_window", self.capability_window, "must be >= 1")
        _require(0.0 < self.capability_min <= 1.0 <= self.capability_max, "capability_min",
                 (self.capability_min, self.capability_max), "and capability_max must satisfy 0 < min <= 1 <= max")

    @property
    def cross_clip_lower(self) -> float:
        """The cross ratio's lower clip bound: min(1, 1 - delta + index * step) (0.85 with the defaults)."""
        return min(1.0, 1.0 - self.cross_clip_delta + self.cross_clip_index * self.cross_clip_step)


ObjectiveConfig = Union[GRPOConfig, XGRPOConfig, PRPConfig, SGTConfig, SGTRefConfig, HACPOConfig]


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"objective config field '{field}' = {value!r} {rule}")
