"""Gradient checks: every objective against a slow reference written here from the formulas.

The reference loops over samples and tokens with Python scalars (no scatter, no masks
as tensors) and shares no code with policies/: it reads OBJECTIVES.md, not the module.
"""

from __future__ import annotations

import math

import pytest
import torch

from policies.objectives import GRPOConfig, ObjectiveBatch, PRPConfig, SGTConfig, XGRPOConfig, compute_loss

DT = torch.float64


# ----------------------------------------------------------------------------- reference


def ref_stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def ref_adv(r: float, base: float, scale: float, cfg) -> float:
    return (r - base) / (scale + cfg.adv_eps) if cfg.std_normalise else r - base


def ref_token_loss(lp, prox, behav, adv, cfg):
    """iw * max(-A rho, -A clip(rho)) with rho = exp(lp - prox), iw = min(exp(prox - behav), cap)."""
    rho = torch.exp(lp - prox)
    iw = min(math.exp(float(prox - behav)), cfg.behav_weight_cap)
    return iw * torch.maximum(-adv * rho, -adv * rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))


def ref_aggregate(rows: list[list[torch.Tensor]], mode: str) -> torch.Tensor:
    """rows: per sample, its list of token losses (only counted tokens)."""
    zero = torch.zeros((), dtype=DT)
    if mode == "token_mean":
        toks = [t for row in rows for t in row]
        return sum(toks, zero) / max(len(toks), 1)
    means = [sum(row, zero) / len(row) for row in rows if row]
    return sum(means, zero) / max(len(means), 1)


def ref_loss(b: ObjectiveBatch, cfg, chosen_peer: dict[int, int] | None = None) -> torch.Tensor:
    B, T = b.logp.shape
    P, T2 = b.peer_logp.shape
    fresh = [int(b.staleness[i]) <= cfg.max_staleness for i in range(B)]
    pfresh = [b.peer_staleness is None or int(b.peer_staleness[j]) <= cfg.max_staleness for j in range(P)]
    kind = cfg.kind
    base, scale = {}, {}
    for q in range(b.num_groups):
        own = [float(b.rewards[i]) for i in range(B) if int(b.group[i]) == q and fresh[i]]
        peer = [float(b.peer_rewards[j]) for j in range(P) if int(b.peer_group[j]) == q and pfresh[j]]
        pool = own + peer if kind in ("xgrpo", "prp") else own
        base[q], scale[q] = ref_stats(pool)
        if kind == "xgrpo" and cfg.leave_own_out and peer:
            base[q] = ref_stats(peer)[0]
    prox = b.prox_logp if b.prox_logp is not None else b.logp.detach()
    rows = []
    for i in range(B):
        row = []
        a = ref_adv(float(b.rewards[i]), base[int(b.group[i])], scale[int(b.group[i])], cfg)
        for t in range(T):
            if b.mask[i, t] > 0 and fresh[i]:
                row.append(ref_token_loss(b.logp[i, t], prox[i, t].detach(), b.behav_logp[i, t], a, cfg))
        rows.append(row)
    if kind == "prp":
        for j in range(P):
            row = []
            a = ref_adv(float(b.peer_rewards[j]), base[int(b.peer_group[j])], scale[int(b.peer_group[j])], cfg)
            toks = [t for t in range(T2) if b.peer_mask[j, t] > 0 and pfresh[j]]
            diffs = {t: float(b.peer_logp[j, t].detach() - b.peer_behav_logp[j, t]) for t in toks}
            for t in toks:
                if cfg.variant == "sequence":
                    log_w = sum(diffs.values())
                elif cfg.variant == "length_norm":
                    log_w = sum(diffs.values()) / len(toks)
                else:
                    log_w = sum(d for u, d in diffs.items() if int(b.peer_align[j, u]) == int(b.peer_align[j, t]))
                w = min(math.exp(log_w), cfg.ratio_cap)
                row.append(-a * w * torch.exp(b.peer_logp[j, t] - b.peer_logp[j, t].detach()))
            rows.append(row)
    loss = ref_aggregate(rows, cfg.aggregation)
    if cfg.kl_coef > 0:
        kl_rows = [
            [torch.exp(b.ref_logp[i, t] - b.logp[i, t]) - (b.ref_logp[i, t] - b.logp[i, t]) - 1 for t in range(T) if b.mask[i, t] > 0 and fresh[i]]
            for i in range(B)
        ]
        loss = loss + cfg.kl_coef * ref_aggregate(kl_rows, cfg.aggregation)
    if kind == "sgt" and chosen_peer:
        nlls = []
        for j in chosen_peer.values():
            toks = [-b.peer_logp[j, t] for t in range(T2) if b.peer_mask[j, t] > 0]
            nll = sum(toks, torch.zeros((), dtype=DT))
            nlls.append(nll / len(toks) if cfg.nll_norm == "token_mean" else nll)
        loss = loss + cfg.lam * sum(nlls) / len(nlls)
    return loss


# ----------------------------------------------------------------------------- random batches


def random_batch(seed: int, *, B=9, T=6, P=7, T2=8, Q=4) -> ObjectiveBatch:
    g = torch.Generator().manual_seed(seed)
    logp = (-2 * torch.rand(B, T, generator=g, dtype=DT)).requires_grad_()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DT)
    mask[0] = 0  # one fully masked row
    prox = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=DT)  # some clipping active
    behav = prox - 1.0 * torch.randn(B, T, generator=g, dtype=DT)  # some iw truncated at the cap
    rewards = torch.randint(0, 2, (B,), generator=g).to(DT) + 0.1 * torch.randn(B, generator=g, dtype=DT)
    group = torch.randint(0, Q - 1, (B,), generator=g)  # group Q-1 stays empty
    staleness = torch.randint(0, 7, (B,), generator=g)
    peer_logp = (-2 * torch.rand(P, T2, generator=g, dtype=DT)).requires_grad_()
    plen = torch.randint(1, T2 + 1, (P,), generator=g)
    peer_mask = (torch.arange(T2)[None] < plen[:, None]).to(DT)
    align = torch.cumsum(torch.rand(P, T2, generator=g) < 0.6, dim=1) - 1
    align = torch.where(peer_mask > 0, align.clamp(min=0), torch.full_like(align, -1))
    return ObjectiveBatch(
        logp=logp,
        behav_logp=behav,
        prox_logp=prox,
        mask=mask,
        rewards=rewards,
        group=group,
        staleness=staleness,
        verified=rewards > 0.5,
        num_groups=Q,
        peer_logp=peer_logp,
        peer_behav_logp=peer_logp.detach() + 0.4 * torch.randn(P, T2, generator=g, dtype=DT),
        peer_mask=peer_mask,
        peer_rewards=torch.randint(0, 2, (P,), generator=g).to(DT),
        peer_group=torch.randint(0, Q - 1, (P,), generator=g),
        peer_verified=torch.rand(P, generator=g) < 0.5,
        peer_residual=torch.rand(P, generator=g, dtype=DT),
        peer_align=align,
        ref_logp=logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=DT),
        peer_staleness=torch.randint(0, 6, (P,), generator=g),
    )


def grads(loss: torch.Tensor, b: ObjectiveBatch) -> tuple[torch.Tensor, torch.Tensor]:
    g_own, g_peer = torch.autograd.grad(loss, [b.logp, b.peer_logp], allow_unused=True)
    return (
        torch.zeros_like(b.logp) if g_own is None else g_own,
        torch.zeros_like(b.peer_logp) if g_peer is None else g_peer,
    )


def check_against_reference(b: ObjectiveBatch, cfg, chosen=None) -> None:
    loss, _ = compute_loss(b, cfg, torch.Generator().manual_seed(0))
    ref = ref_loss(b, cfg, chosen)
    assert torch.allclose(loss, ref, rtol=1e-9, atol=1e-12), (float(loss), float(ref))
    for fast, slow in zip(grads(loss, b), grads(ref, b)):
        assert torch.allclose(fast, slow, rtol=1e-9, atol=1e-12), (fast - slow).abs().max()


CONFIGS = [
    GRPOConfig(),
    GRPOConfig(aggregation="seq_mean", std_normalise=False, kl_coef=0.05, max_staleness=2),
    XGRPOConfig(),
    XGRPOConfig(leave_own_out=True, aggregation="seq_mean"),
    XGRPOConfig(std_normalise=False, kl_coef=0.1),
    PRPConfig(),
    PRPConfig(variant="length_norm", aggregation="seq_mean", ratio_cap=1.5),
    PRPConfig(variant="token", ratio_cap=3.0, kl_coef=0.02),
    SGTConfig(),  # random batches rarely hold a rescue group: the GRPO part is checked here
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.kind}")
def test_matches_slow_reference(cfg, seed):
    b = random_batch(seed)
    check_against_reference(b, cfg)


def test_reference_batches_exercise_clipping_truncation_and_staleness():
    stats = compute_loss(random_batch(0), PRPConfig(variant="token"), torch.Generator().manual_seed(0))[1]
    assert stats["clip_frac"] > 0
    # TRL's clip_ratio/low_mean and high_mean: the two sides of the region, which together are clip_frac
    assert stats["clip_low_frac"] > 0
    assert stats["clip_low_frac"] + stats["clip_high_frac"] == pytest.approx(stats["clip_frac"])
    assert stats["iw_truncated_frac"] > 0
    assert stats["staleness_dropped"] > 0
    assert 0 < stats["w_truncated_frac"] < 1


@pytest.mark.parametrize("nll_norm", ["token_mean", "sum"])
def test_sgt_matches_reference_on_rescue_groups(nll_norm):
    b = random_batch(3)
    # Groups 0 and 1: every own sample fails, exactly one verified peer each -> the choice is forced.
    b.staleness.zero_()
    b.peer_staleness.zero_()
    b.verified[:] = b.group == 2
    b.rewards = torch.where(b.verified, 1.0, 0.0).to(DT)
    b.peer_verified[:] = False
    for q in (0, 1):
        rows = (b.peer_group == q).nonzero().flatten()
        assert rows.numel() > 0
        b.peer_verified[rows[0]] = True
    chosen = {q: int((b.peer_verified & (b.peer_group == q)).nonzero()[0]) for q in (0, 1) if bool((b.group == q).any())}
    cfg = SGTConfig(lam=0.3, nll_norm=nll_norm)
    _, stats = compute_loss(b, cfg, torch.Generator().manual_seed(0))
    assert stats["rescue_set_size"] == len(chosen) > 0
    check_against_reference(b, cfg, chosen)


def test_decoupled_surrogate_matches_finite_differences():
    b = random_batch(4, B=4, T=3, P=3, T2=3, Q=2)
    cfg = PRPConfig(variant="token", kl_coef=0.1)
    rng = torch.Generator().manual_seed(0)

    def own_only(x):
        b.logp = x
        return compute_loss(b, cfg, rng)[0]

    # Finite differences agree with autograd away from the clip kinks (random values avoid them).
    assert torch.autograd.gradcheck(own_only, (b.logp.detach().clone().requires_grad_(),), eps=1e-7, atol=1e-6)
