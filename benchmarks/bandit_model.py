"""Softmax contextual bandit: the stability-support trade-off of GRPO, XGRPO, PRP and SGT, exactly.

Contexts are prompts, arms are whole responses. The receiver's policy is
pi(a | k) = softmax(theta[k]); a fixed peer policy mu(a | k) = softmax(peer_logits[k])
has different support. One update draws G own arms from pi and Gp peer arms from mu for
a context and forms the method's ascent direction u (minus the gradient of its loss
with respect to theta[k], for a batch holding that one group):

    score(a)  = onehot(a) - pi                        (= d log pi(a) / d theta)
    grpo      u = 1/G      sum_i A_i score(y_i),       A from own rewards
    xgrpo     u = 1/G      sum_i A_i score(y_i),       A from own + peer rewards
    prp       u = 1/(G+Gp) [sum_i A_i score(y_i) + sum_j w_j A_j score(z_j)],
              w_j = min(pi(z_j) / mu_hat(z_j), c),     A pooled
    sgt       u = grpo + lambda * 1[own all fail, a peer succeeds] * mean_{j: z_j verified} score(z_j)

These are the single-token (T = 1), on-policy cases of policies.objectives (tested to
agree); SGT's uniform draw of one success is replaced by its expectation. mu_hat is the
peer log-prob as PRP sees it after the THL: mu times exp(residual).

Everything is exact: the expected direction E[u] and its total variance E||u - E u||^2
are sums over all N^(G+Gp) joint draws, weighted by their probability.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

METHODS = ("grpo", "xgrpo", "prp", "sgt")


@dataclass(frozen=True)
class Bandit:
    """A contextual bandit with a receiver start point and a fixed peer."""

    reward: Tensor  # (K, N) 1.0 = verified success of arm a in context k, else 0.0
    receiver_logits: Tensor  # (K, N) theta at the start
    peer_logits: Tensor  # (K, N) the peer's fixed policy
    residual: Tensor  # (K, N) THL error on the peer's recorded log-prob (0 = perfect bridge)
    group_size: int = 4  # G own draws per context and update
    peer_group_size: int = 4  # Gp peer draws per context and update


@dataclass(frozen=True)
class Hyper:
    """The objectives' knobs, at their policies.objective_config defaults."""

    ratio_cap: float = 2.0  # PRP's c
    sgt_lambda: float = 0.1
    adv_eps: float = 1e-6
    std_normalise: bool = True


def _advantages(rewards: Tensor, pool: Tensor, hyper: Hyper) -> Tensor:
    """(r - mean(pool)) / (std(pool) + eps) along the last dim; std is the population std."""
    mean = pool.mean(dim=-1, keepdim=True)
    centred = rewards - mean
    if not hyper.std_normalise:
        return centred
    return centred / (pool.std(dim=-1, unbiased=False, keepdim=True) + hyper.adv_eps)


def ascent_direction(method: str, bandit: Bandit, theta: Tensor, own: Tensor, peer: Tensor, hyper: Hyper) -> Tensor:
    """u (..., K, N) for draws own (..., K, G) and peer (..., K, Gp) at parameters theta (..., K, N)."""
    log_pi = theta.log_softmax(dim=-1)
    pi = log_pi.exp()
    reward = bandit.reward.to(theta.dtype)
    r_own = reward.expand_as(theta).gather(-1, own)  # (..., K, G)
    r_peer = reward.expand_as(theta).gather(-1, peer)  # (..., K, Gp)
    N = theta.shape[-1]
    score_own = torch.nn.functional.one_hot(own, N).to(theta.dtype) - pi[..., None, :]  # (..., K, G, N)
    score_peer = torch.nn.functional.one_hot(peer, N).to(theta.dtype) - pi[..., None, :]  # (..., K, Gp, N)
    G, Gp = own.shape[-1], peer.shape[-1]
    if method in ("grpo", "sgt"):
        adv = _advantages(r_own, r_own, hyper)
        u = (adv[..., None] * score_own).sum(dim=-2) / G
        if method == "sgt":
            wins = (r_peer > 0).to(theta.dtype)
            rescue = ((r_own > 0).sum(dim=-1) == 0) & (wins.sum(dim=-1) > 0)  # (..., K)
            toward = (wins[..., None] * score_peer).sum(dim=-2) / wins.sum(dim=-1, keepdim=True).clamp(min=1)
            u = u + hyper.sgt_lambda * rescue[..., None].to(theta.dtype) * toward
        return u
    pool = torch.cat([r_own, r_peer], dim=-1)
    adv = _advantages(r_own, pool, hyper)
    if method == "xgrpo":
        return (adv[..., None] * score_own).sum(dim=-2) / G
    if method == "prp":
        peer_adv = _advantages(r_peer, pool, hyper)
        log_mu_hat = bandit.peer_logits.log_softmax(dim=-1).to(theta.dtype) + bandit.residual.to(theta.dtype)
        log_ratio = log_pi.gather(-1, peer) - log_mu_hat.expand_as(theta).gather(-1, peer)
        w = log_ratio.exp().clamp(max=hyper.ratio_cap)
        own_part = (adv[..., None] * score_own).sum(dim=-2)
        peer_part = ((w * peer_adv)[..., None] * score_peer).sum(dim=-2)
        return (own_part + peer_part) / (G + Gp)
    raise ValueError(f"unknown bandit method {method!r}; choose one of {', '.join(METHODS)}")


@dataclass(frozen=True)
class Outcomes:
    """Every joint draw of G own and Gp peer arms, with its probability in each context."""

    own: Tensor  # (M, G) long
    peer: Tensor  # (M, Gp) long
    prob: Tensor  # (K, M), rows sum to 1


def enumerate_outcomes(bandit: Bandit, theta: Tensor) -> Outcomes:
    K, N = theta.shape
    G, Gp = bandit.group_size, bandit.peer_group_size
    draws = torch.tensor(list(itertools.product(range(N), repeat=G + Gp)), dtype=torch.long)  # (M, G + Gp)
    own, peer = draws[:, :G], draws[:, G:]
    log_pi = theta.log_softmax(-1)
    log_mu = bandit.peer_logits.to(theta.dtype).log_softmax(-1)
    log_p = log_pi[:, own].sum(-1) + log_mu[:, peer].sum(-1)  # (K, M)
    return Outcomes(own, peer, log_p.exp())


@dataclass(frozen=True)
class GradientMoments:
    mean: Tensor  # (K, N) E[u]
    variance: Tensor  # (K,) E||u - E[u]||^2, the total variance of one group's update


def gradient_moments(method: str, bandit: Bandit, theta: Tensor, hyper: Hyper, outcomes: Outcomes | None = None) -> GradientMoments:
    """Exact mean and total variance of the method's ascent direction at theta (K, N)."""
    out = outcomes if outcomes is not None else enumerate_outcomes(bandit, theta)
    M, K, N = out.own.shape[0], *theta.shape
    own = out.own[:, None, :].expand(M, K, -1)  # (M, K, G): the same joint draw in every context
    peer = out.peer[:, None, :].expand(M, K, -1)
    u = ascent_direction(method, bandit, theta[None].expand(M, K, N), own, peer, hyper).transpose(0, 1)  # (K, M, N)
    mean = (out.prob[..., None] * u).sum(dim=1)
    variance = (out.prob * ((u - mean[:, None, :]) ** 2).sum(-1)).sum(dim=1)
    return GradientMoments(mean, variance)


def rare_success_arms(bandit: Bandit, threshold: float) -> Tensor:
    """(K, N) bool: verified-success arms the receiver's starting policy samples with prob < threshold."""
    pi0 = bandit.receiver_logits.softmax(-1)
    return (pi0 < threshold) & (bandit.reward > 0)


def success_rate(bandit: Bandit, theta: Tensor) -> Tensor:
    """(..., K) expected reward of the receiver's policy per context."""
    return (theta.softmax(-1) * bandit.reward.to(theta.dtype)).sum(-1)


def learning_curve(
    method: str, bandit: Bandit, hyper: Hyper, *, steps: int, lr: float, replicas: int, seed: int
) -> Tensor:
    """Iterate theta += lr * u on sampled groups; (steps + 1, K) success per context, mean over replicas."""
    gen = torch.Generator().manual_seed(seed)
    K, N = bandit.receiver_logits.shape
    theta = bandit.receiver_logits.to(torch.float64).expand(replicas, K, N).clone()
    mu = bandit.peer_logits.to(torch.float64).softmax(-1)
    curve = [success_rate(bandit, theta).mean(0)]
    for _ in range(steps):
        own = torch.multinomial(theta.softmax(-1).reshape(-1, N), bandit.group_size, replacement=True, generator=gen)
        peer = torch.multinomial(mu.expand(replicas, K, N).reshape(-1, N), bandit.peer_group_size, replacement=True, generator=gen)
        u = ascent_direction(method, bandit, theta, own.view(replicas, K, -1), peer.view(replicas, K, -1), hyper)
        theta = theta + lr * u
        curve.append(success_rate(bandit, theta).mean(0))
    return torch.stack(curve)


@dataclass(frozen=True)
class Probe:
    """One row of the analysis: an update rule and its knobs."""

    name: str  # row label, e.g. "prp_c2"
    method: str  # one of METHODS
    hyper: Hyper = Hyper()


def default_probes() -> list[Probe]:
    """The four methods (PRP with the raw density ratio) plus PRP at finite truncation caps."""
    inf = float("inf")
    return [
        Probe("grpo", "grpo"),
        Probe("xgrpo", "xgrpo"),
        Probe("prp", "prp", Hyper(ratio_cap=inf)),
        Probe("sgt", "sgt"),
        Probe("prp_c10", "prp", Hyper(ratio_cap=10.0)),
        Probe("prp_c5", "prp", Hyper(ratio_cap=5.0)),
        Probe("prp_c2", "prp", Hyper(ratio_cap=2.0)),
    ]


@dataclass(frozen=True)
class ProbeReport:
    grad_norm: float  # ||E[u]|| over all contexts
    grad_variance: float  # sum over contexts of E||u - E[u]||^2 (one group per context)
    support_gain: float  # sum of E[u] on rare verified-success arms: logit mass toward them
    support_gain_never: float  # the same where the receiver's probability of those arms is exactly 0
    residual_bias: float  # ||E[u] - E[u] under a perfect bridge||: what the THL residual shifts
    truncation_bias: float  # ||E[u] - E[u] of the same method with no ratio cap|| (PRP only; else 0)
    w_var: float  # sum over contexts of Var_mu(w) of the PRP weight (0 for the other methods)
    final_success: float  # mean success over contexts after the learning curve
    rescue_success: float  # success on the contexts that hold a rare success arm, after the curve
    per_context_variance: list[float] = field(default_factory=list)
    curve: list[float] = field(default_factory=list)  # mean success over contexts per step


def _weight_variance(bandit: Bandit, theta: Tensor, cap: float) -> float:
    log_mu = bandit.peer_logits.to(theta.dtype).log_softmax(-1)
    w = (theta.log_softmax(-1) - log_mu - bandit.residual.to(theta.dtype)).exp().clamp(max=cap)
    mu = log_mu.exp()
    return float(((mu * w * w).sum(-1) - (mu * w).sum(-1) ** 2).sum())


def analyse(
    bandit: Bandit, probes: list[Probe] | None = None, *, rare_threshold: float = 1e-3, steps: int = 200,
    lr: float = 1.0, replicas: int = 32, seed: int = 0,
) -> dict[str, ProbeReport]:
    """Exact gradient statistics at the start point plus a sampled learning curve, per probe."""
    probes = probes if probes is not None else default_probes()
    theta0 = bandit.receiver_logits.to(torch.float64)
    rare = rare_success_arms(bandit, rare_threshold)
    never = theta0.masked_fill(rare, float("-inf"))  # the limit where the receiver never samples them
    clean = Bandit(bandit.reward, bandit.receiver_logits, bandit.peer_logits, torch.zeros_like(bandit.residual),
                   bandit.group_size, bandit.peer_group_size)
    outcomes, never_outcomes = enumerate_outcomes(bandit, theta0), enumerate_outcomes(bandit, never)
    rescue_contexts = rare.any(-1)
    reports = {}
    for probe in probes:
        moments = gradient_moments(probe.method, bandit, theta0, probe.hyper, outcomes)
        clean_mean = gradient_moments(probe.method, clean, theta0, probe.hyper, outcomes).mean
        uncapped = replace(probe.hyper, ratio_cap=float("inf"))
        uncapped_mean = gradient_moments(probe.method, bandit, theta0, uncapped, outcomes).mean
        never_mean = gradient_moments(probe.method, bandit, never, probe.hyper, never_outcomes).mean
        curve = learning_curve(probe.method, bandit, probe.hyper, steps=steps, lr=lr, replicas=replicas, seed=seed)
        reports[probe.name] = ProbeReport(
            grad_norm=float(moments.mean.norm()),
            grad_variance=float(moments.variance.sum()),
            support_gain=float((moments.mean * rare).sum()),
            support_gain_never=float((never_mean * rare).sum()),
            residual_bias=float((moments.mean - clean_mean).norm()),
            truncation_bias=float((moments.mean - uncapped_mean).norm()),
            w_var=_weight_variance(bandit, theta0, probe.hyper.ratio_cap) if probe.method == "prp" else 0.0,
            final_success=float(curve[-1].mean()),
            rescue_success=float(curve[-1][rescue_contexts].mean()) if bool(rescue_contexts.any()) else 0.0,
            per_context_variance=[float(v) for v in moments.variance],
            curve=[float(c) for c in curve.mean(-1)],
        )
    return reports


def paper_bandit(residual_scale: float = 0.3, seed: int = 0, group_size: int = 3, peer_group_size: int = 3) -> Bandit:
    """Four prompts, four responses, a peer with different support (the scenario of the paper's argument).

    0 rescue:    only arm 3 is correct; the receiver almost never samples it (p ~ 5e-7), the peer mostly does.
    1 shared:    arm 0 is correct; both policies find it sometimes.
    2 support:   arms 1 and 3 correct; the peer lives on arms 2-3, the receiver on 0-2 (ratios far from 1).
    3 weak peer: arm 2 correct; the receiver is fair, the peer rarely succeeds.
    """
    gen = torch.Generator().manual_seed(seed)
    reward = torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.float64)
    receiver = torch.tensor([[2.0, 1.0, 0.0, -12.0], [0.5, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, -12.0], [0.0, 0.0, 1.0, 0.0]],
                            dtype=torch.float64)
    peer = torch.tensor([[0.0, -1.0, -1.0, 1.5], [1.0, 0.0, 0.0, -1.0], [-3.0, -3.0, 0.0, 2.0], [1.0, 1.0, -2.0, 1.0]],
                        dtype=torch.float64)
    residual = residual_scale * torch.randn(reward.shape, generator=gen, dtype=torch.float64)
    return Bandit(reward, receiver, peer, residual, group_size, peer_group_size)
