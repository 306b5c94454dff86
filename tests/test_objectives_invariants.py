"""The invariants of issue 4, one test each (plus staleness and edge cases)."""

from __future__ import annotations

import pytest
import torch

from policies.advantages import grpo_advantages, pooled_advantages
from policies.objectives import (
    GRPOConfig,
    HACPOConfig,
    ObjectiveBatch,
    PRPConfig,
    SGTConfig,
    XGRPOConfig,
    compute_loss,
    pick_one_per_group,
)

DT = torch.float64
ALL_CONFIGS = [GRPOConfig(), XGRPOConfig(), XGRPOConfig(leave_own_out=True), PRPConfig(), PRPConfig(variant="token"),
               PRPConfig(variant="length_norm", aggregation="seq_mean"), SGTConfig(), HACPOConfig()]


def rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_batch(own_logp, own_behav, own_mask, rewards, group, Q, peer_logp=None, peer_behav=None, peer_mask=None,
               peer_rewards=None, peer_group=None, peer_verified=None, align=None, staleness=None) -> ObjectiveBatch:
    """Batch with explicit own and peer parts; peer fields default to P = 0."""
    B = own_logp.shape[0]
    if peer_logp is None:
        return ObjectiveBatch.solo(logp=own_logp, behav_logp=own_behav, mask=own_mask, rewards=rewards, group=group,
                                   num_groups=Q, staleness=staleness)
    P, T2 = peer_logp.shape
    if align is None:
        align = torch.where(peer_mask > 0, torch.arange(T2).expand(P, T2), -1)
    return ObjectiveBatch(
        logp=own_logp, behav_logp=own_behav, prox_logp=None, mask=own_mask, rewards=rewards, group=group,
        staleness=torch.zeros(B, dtype=torch.long) if staleness is None else staleness, verified=rewards > 0,
        num_groups=Q, peer_logp=peer_logp, peer_behav_logp=peer_behav, peer_mask=peer_mask, peer_rewards=peer_rewards,
        peer_group=peer_group, peer_verified=peer_rewards > 0 if peer_verified is None else peer_verified,
        peer_residual=torch.zeros(P, dtype=DT), peer_align=align,
    )


def random_policy_batch(seed: int, G: int = 4, T: int = 5, Q: int = 2):
    """2G samples per group from one policy: first G are 'own', last G are 'peer' (peer = self)."""
    g = rng(seed)
    n = 2 * G * Q
    all_logp = (-2 * torch.rand(n, T, generator=g, dtype=DT)).requires_grad_()
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DT)
    rewards = torch.randint(0, 2, (n,), generator=g).to(DT)
    group = torch.arange(Q).repeat_interleave(2 * G)
    own = torch.cat([torch.arange(q * 2 * G, q * 2 * G + G) for q in range(Q)])
    peer = own + G
    return all_logp, mask, rewards, group, own, peer


@pytest.mark.parametrize("cfg", [PRPConfig(), PRPConfig(variant="token"), PRPConfig(variant="length_norm", aggregation="seq_mean")],
                         ids=lambda c: c.variant)
def test_prp_with_peer_equal_self_is_grpo_on_pooled_group(cfg):
    all_logp, mask, rewards, group, own, peer = random_policy_batch(0)
    behav = all_logp.detach()  # on-policy: the generator's log-probs are the current ones
    prp_batch = make_batch(all_logp[own], behav[own], mask[own], rewards[own], group[own], 2,
                           peer_logp=all_logp[peer], peer_behav=behav[peer], peer_mask=mask[peer],
                           peer_rewards=rewards[peer], peer_group=group[peer])
    prp_loss, stats = compute_loss(prp_batch, cfg, rng())
    grpo_cfg = GRPOConfig(aggregation=cfg.aggregation)
    grpo_loss, _ = compute_loss(make_batch(all_logp, behav, mask, rewards, group, 2), grpo_cfg, rng())
    assert stats["w_mean"] == 1.0 and stats["w_var"] == 0.0 and stats["w_truncated_frac"] == 0.0
    assert torch.allclose(prp_loss, grpo_loss, rtol=1e-12)
    (g_prp,) = torch.autograd.grad(prp_loss, all_logp)
    (g_grpo,) = torch.autograd.grad(grpo_loss, all_logp)
    assert g_grpo.abs().sum() > 0
    assert torch.allclose(g_prp, g_grpo, rtol=1e-10, atol=1e-14)


def test_xgrpo_with_peer_rewards_equal_own_has_grpo_baseline_on_doubled_group():
    all_logp, mask, rewards, group, own, _ = random_policy_batch(1)
    r, g = rewards[own], group[own]
    keep = torch.ones_like(r, dtype=torch.bool)
    x = pooled_advantages(r, g, keep, r.clone(), g.clone(), keep.clone(), 2, True, 1e-6)
    doubled = grpo_advantages(torch.cat([r, r]), torch.cat([g, g]), torch.cat([keep, keep]), 2, True, 1e-6)
    assert torch.equal(x.baseline, doubled.baseline) and torch.equal(x.scale, doubled.scale)
    assert torch.equal(x.own, doubled.own[: len(r)])
    # And the loss/gradient is GRPO's on the doubled group (whose copies each take half the gradient).
    lp = all_logp[own]
    xb = make_batch(lp, lp.detach(), mask[own], r, g, 2, peer_logp=lp.detach(), peer_behav=lp.detach(),
                    peer_mask=mask[own], peer_rewards=r.clone(), peer_group=g.clone())
    x_loss, stats = compute_loss(xb, XGRPOConfig(), rng())
    twice = torch.cat([lp, lp])
    d_loss, _ = compute_loss(make_batch(twice, twice.detach(), torch.cat([mask[own]] * 2), torch.cat([r, r]),
                                        torch.cat([g, g]), 2), GRPOConfig(), rng())
    assert stats["baseline_shift_mean"] == 0.0
    assert torch.allclose(x_loss, d_loss, rtol=1e-12)
    g_x = torch.autograd.grad(x_loss, all_logp, retain_graph=True)[0]
    assert torch.allclose(g_x, torch.autograd.grad(d_loss, all_logp)[0], rtol=1e-10) and g_x.abs().sum() > 0


@pytest.mark.parametrize("leave_own_out", [False, True])
def test_xgrpo_gradient_is_zero_for_everything_but_own_samples(leave_own_out):
    all_logp, mask, rewards, group, own, peer = random_policy_batch(2)
    peer_logp = all_logp[peer].detach().clone().requires_grad_()
    peer_behav = (peer_logp.detach() - 0.5).requires_grad_()
    cfg = XGRPOConfig(leave_own_out=leave_own_out)

    def run(pl, pb, pm):
        b = make_batch(all_logp[own], all_logp[own].detach() - 0.1, mask[own], rewards[own], group[own], 2,
                       peer_logp=pl, peer_behav=pb, peer_mask=pm, peer_rewards=rewards[peer], peer_group=group[peer])
        return compute_loss(b, cfg, rng())[0]

    loss = run(peer_logp, peer_behav, mask[peer])
    g_all, g_peer, g_behav = torch.autograd.grad(loss, [all_logp, peer_logp, peer_behav], allow_unused=True)
    assert g_peer is None and g_behav is None
    assert torch.all(g_all[peer] == 0) and g_all[own].abs().sum() > 0
    # Peer tokens do not enter the loss at all: scrambling them changes nothing.
    scrambled = run(torch.randn_like(peer_logp), torch.randn_like(peer_behav), torch.ones_like(mask[peer]))
    assert torch.equal(loss, scrambled)


@pytest.mark.parametrize("cfg", [XGRPOConfig(), XGRPOConfig(leave_own_out=True), XGRPOConfig(std_normalise=False)],
                         ids=["pooled", "leave_own_out", "mean_only"])
def test_xgrpo_own_advantages_all_negative_when_own_group_fails_and_peer_succeeds(cfg):
    G, T = 4, 3
    logp = (-torch.rand(G, T, dtype=DT)).requires_grad_()
    b = make_batch(logp, logp.detach(), torch.ones(G, T, dtype=DT), torch.zeros(G, dtype=DT), torch.zeros(G, dtype=torch.long), 1,
                   peer_logp=torch.zeros(3, 2, dtype=DT), peer_behav=torch.zeros(3, 2, dtype=DT), peer_mask=torch.ones(3, 2, dtype=DT),
                   peer_rewards=torch.tensor([0.0, 1.0, 0.0], dtype=DT), peer_group=torch.zeros(3, dtype=torch.long))
    keep = torch.ones(G, dtype=torch.bool)
    adv = pooled_advantages(b.rewards, b.group, keep, b.peer_rewards, b.peer_group, torch.ones(3, dtype=torch.bool), 1,
                            cfg.std_normalise, cfg.adv_eps, cfg.leave_own_out).own
    assert torch.all(adv < 0)
    loss, stats = compute_loss(b, cfg, rng())
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.all(g > 0)  # descent lowers every failed own sample's log-prob
    assert stats["adv_mean"] < 0
    # Solo GRPO has no signal at all on this group.
    (g_solo,) = torch.autograd.grad(compute_loss(b, GRPOConfig(), rng())[0], logp)
    assert torch.all(g_solo == 0)


def _sgt_batch(own_rewards, peer_rewards, own_group, peer_group, Q, T=4, T2=5, seed=0):
    g = rng(seed)
    B, P = len(own_rewards), len(peer_rewards)
    logp = (-torch.rand(B, T, generator=g, dtype=DT)).requires_grad_()
    peer_logp = (-torch.rand(P, T2, generator=g, dtype=DT)).requires_grad_()
    return make_batch(logp, logp.detach(), torch.ones(B, T, dtype=DT), torch.tensor(own_rewards, dtype=DT),
                      torch.tensor(own_group), Q, peer_logp=peer_logp, peer_behav=peer_logp.detach() - 0.3,
                      peer_mask=torch.ones(P, T2, dtype=DT), peer_rewards=torch.tensor(peer_rewards, dtype=DT),
                      peer_group=torch.tensor(peer_group))


def test_sgt_adds_nothing_outside_rescue_set():
    # group 0: own success -> not rescued; group 1: own fail, peers fail -> not rescued; group 2: no own samples.
    b = _sgt_batch([1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2], 3)
    sgt, stats = compute_loss(b, SGTConfig(lam=1.0), rng())
    grpo, _ = compute_loss(b, GRPOConfig(), rng())
    assert stats["rescue_set_size"] == 0 and stats["sgt_nll"] == 0.0
    assert torch.equal(sgt, grpo)
    g_peer = torch.autograd.grad(sgt, b.peer_logp, allow_unused=True)[0]
    assert g_peer is None or torch.all(g_peer == 0)


def test_sgt_extra_gradient_only_on_one_success_of_each_rescue_group():
    # group 0 rescued (own all fail, two peer successes); group 1 not (own success) although a peer succeeds.
    b = _sgt_batch([0, 0, 0, 1, 0], [1, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1], 2)
    loss, stats = compute_loss(b, SGTConfig(lam=0.5), rng(3))
    (g_peer,) = torch.autograd.grad(loss, b.peer_logp)
    touched = (g_peer != 0).any(dim=1)
    assert stats["rescue_set_size"] == 1
    assert touched.sum() == 1 and bool(touched[0] | touched[2]) and not bool(touched[1] | touched[3])
    assert torch.allclose(g_peer[touched], torch.full_like(g_peer[touched], -0.5 / 5))  # lambda * d(token-mean NLL)


def test_sgt_success_is_drawn_uniformly_and_reproducibly():
    eligible = torch.tensor([True, False, True, True, True])
    group = torch.tensor([0, 0, 0, 0, 1])
    counts = torch.zeros(5)
    for seed in range(600):
        chosen = pick_one_per_group(eligible, group, 2, rng(seed))
        assert chosen[4] and chosen[:4].sum() == 1
        counts += chosen.double()
    assert counts[1] == 0 and torch.all((counts[[0, 2, 3]] > 160) & (counts[[0, 2, 3]] < 240))
    assert torch.equal(pick_one_per_group(eligible, group, 2, rng(7)), pick_one_per_group(eligible, group, 2, rng(7)))


def test_truncation_caps_are_respected():
    G, T = 4, 6
    g = rng(5)
    logp = (-torch.rand(G, T, generator=g, dtype=DT)).requires_grad_()
    behav = logp.detach() - 5.0  # pi_prox / pi_behav = e^5, far above the cap
    peer_logp = (-torch.rand(G, T, generator=g, dtype=DT)).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    zero = torch.zeros(G, dtype=torch.long)
    for variant in ("sequence", "length_norm", "token"):
        cfg = PRPConfig(variant=variant, ratio_cap=1.7, behav_weight_cap=2.5)
        b = make_batch(logp, behav, torch.ones(G, T, dtype=DT), rewards, zero, 1, peer_logp=peer_logp,
                       peer_behav=peer_logp.detach() - 3.0, peer_mask=torch.ones(G, T, dtype=DT), peer_rewards=rewards, peer_group=zero)
        loss, stats = compute_loss(b, cfg, rng())
        assert stats["iw_max"] == pytest.approx(2.5) and stats["iw_truncated_frac"] == 1.0
        assert stats["w_max"] == pytest.approx(1.7) and stats["w_truncated_frac"] == 1.0
        g_own, g_peer = torch.autograd.grad(loss, [logp, peer_logp])
        n_tokens = 2 * G * T
        adv = (rewards - 0.5) / (0.5 + cfg.adv_eps)
        # rho = 1 here, so each token's gradient is exactly -A * capped weight / N.
        assert torch.allclose(g_own, (-adv * 2.5 / n_tokens)[:, None].expand(G, T))
        assert torch.allclose(g_peer, (-adv * 1.7 / n_tokens)[:, None].expand(G, T))


def test_ppo_clip_zeroes_gradient_outside_trust_region():
    logp = torch.zeros(2, 1, dtype=DT, requires_grad=True)
    prox = torch.tensor([[-1.0], [1.0]], dtype=DT)  # rho = e (above 1 + eps_high), 1/e (below 1 - eps_low)
    b = make_batch(logp, prox, torch.ones(2, 1, dtype=DT), torch.tensor([1.0, 0.0], dtype=DT), torch.zeros(2, dtype=torch.long), 1)
    b.prox_logp = prox
    loss, stats = compute_loss(b, GRPOConfig(), rng())
    (g,) = torch.autograd.grad(loss, logp)
    # A = +1 with rho > 1 + eps_high and A = -1 with rho < 1 - eps_low: both clipped, no gradient.
    assert stats["clip_frac"] == 1.0 and torch.all(g == 0)


def _edge_batches():
    """fully masked (with -inf/NaN padding), empty groups, zero-variance groups, all-equal rewards, singletons."""
    T, T2 = 4, 3
    out = {}
    for name, own_r, own_g, peer_r, peer_g, Q, masked in [
        ("fully_masked", [1, 0, 1], [0, 0, 1], [1, 0], [0, 1], 2, True),
        ("empty_groups", [1, 0, 1, 1], [1, 1, 3, 3], [0, 1], [3, 5], 7, False),
        ("zero_variance", [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1], [1, 1, 0], [0, 0, 1], 2, False),
        ("all_equal", [0.3] * 5, [0, 0, 1, 1, 1], [0.3, 0.3], [0, 1], 2, False),
        ("singletons", [1, 0], [0, 1], [1], [1], 2, False),
        ("no_peers", [1, 0], [0, 0], [], [], 1, False),
    ]:
        B, P = len(own_r), len(peer_r)
        logp = torch.full((B, T), -0.5, dtype=DT)
        mask = torch.ones(B, T, dtype=DT)
        peer_logp = torch.full((P, T2), -0.7, dtype=DT)
        peer_mask = torch.ones(P, T2, dtype=DT)
        if masked:
            mask.zero_(), peer_mask.zero_()
            logp[:, 1:] = -float("inf")
            peer_logp[:, 2:] = float("nan")
        behav = logp.clone()
        behav[:, -1] = float("nan")
        out[name] = (logp.requires_grad_(), behav, mask, own_r, own_g, peer_logp.requires_grad_(), peer_mask, peer_r, peer_g, Q)
    return out


@pytest.mark.parametrize("case", list(_edge_batches()))
@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.kind)
def test_gradients_finite_on_edge_cases(case, cfg):
    logp, behav, mask, own_r, own_g, peer_logp, peer_mask, peer_r, peer_g, Q = _edge_batches()[case]
    if case != "fully_masked":
        behav = logp.detach().clone()
    P, T2 = peer_logp.shape
    b = make_batch(logp, behav, mask, torch.tensor(own_r, dtype=DT), torch.tensor(own_g), Q, peer_logp=peer_logp,
                   peer_behav=peer_logp.detach().clone(), peer_mask=peer_mask, peer_rewards=torch.tensor(peer_r, dtype=DT).reshape(P),
                   peer_group=torch.tensor(peer_g, dtype=torch.long).reshape(P), align=torch.where(peer_mask > 0, 0, -1).long())
    loss, stats = compute_loss(b, cfg, rng())
    g_own, g_peer = torch.autograd.grad(loss, [logp, peer_logp], allow_unused=True)
    assert torch.isfinite(loss) and all(isinstance(v, float) and v == v for v in stats.values())
    for g in (g_own, g_peer):
        assert g is None or torch.all(torch.isfinite(g))
    if case in ("fully_masked", "all_equal") or (case == "zero_variance" and cfg.kind in ("grpo", "sgt")):
        assert float(loss.detach()) == 0.0 and torch.all(g_own == 0)


def test_stale_samples_are_masked_and_counted():
    logp = (-torch.rand(4, 3, dtype=DT)).requires_grad_()
    b = make_batch(logp, logp.detach(), torch.ones(4, 3, dtype=DT), torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=DT),
                   torch.zeros(4, dtype=torch.long), 1, staleness=torch.tensor([0, 9, 4, 5]))
    loss, stats = compute_loss(b, GRPOConfig(max_staleness=4), rng())
    (g,) = torch.autograd.grad(loss, logp)
    assert stats["staleness_dropped"] == 2.0 and stats["tokens"] == 6.0
    assert torch.all(g[[1, 3]] == 0) and torch.all(g[[0, 2]] != 0)


def test_kl_needs_reference_and_is_zero_at_reference():
    logp = (-torch.rand(2, 3, dtype=DT)).requires_grad_()
    b = make_batch(logp, logp.detach(), torch.ones(2, 3, dtype=DT), torch.tensor([1.0, 0.0], dtype=DT), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss(b, GRPOConfig(kl_coef=0.1), rng())
    b.ref_logp = logp.detach().clone()
    assert compute_loss(b, GRPOConfig(kl_coef=0.1), rng())[1]["kl"] == 0.0


def test_bad_batch_shapes_name_the_field():
    logp = torch.zeros(3, 4)
    b = make_batch(logp, logp, torch.ones(3, 5), torch.zeros(3), torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="ObjectiveBatch.mask"):
        compute_loss(b, GRPOConfig(), rng())
    b = make_batch(logp, logp, torch.ones(3, 4), torch.zeros(3), torch.tensor([0, 1, 2]), 2)
    with pytest.raises(ValueError, match="ObjectiveBatch.group"):
        compute_loss(b, GRPOConfig(), rng())


@pytest.mark.parametrize("variant,expected", [("sequence", torch.tensor(-3.0, dtype=DT).exp()),
                                              ("length_norm", torch.tensor(-3.0 / 12, dtype=DT).exp())])
def test_prp_caps_the_summed_log_ratio_not_each_token(variant, expected):
    """One token at -25 and eleven at +2: w = exp(-3) (or exp(-3/12)), not the cap a per-token clamp would give."""
    from policies.objectives import prp_weights

    log_r = torch.tensor([[-25.0] + [2.0] * 11], dtype=DT)
    recv = torch.zeros(1, 12, dtype=DT)
    mask = torch.ones(1, 12, dtype=DT)
    align = torch.arange(12)[None]
    w, unit_w, truncated = prp_weights(recv, recv - log_r, mask, align, variant, cap=5.0)
    assert unit_w.item() == pytest.approx(expected.item(), rel=1e-12)
    assert not truncated.any()
    assert torch.all(w == unit_w.item())


def test_prp_and_behaviour_weights_equal_the_cap_exactly_when_truncated():
    from policies.objectives import prp_weights
    from policies.surrogate import behaviour_weight

    mask = torch.ones(2, 3, dtype=DT)
    _, unit_w, truncated = prp_weights(torch.zeros(2, 3, dtype=DT), torch.full((2, 3), -4.0, dtype=DT), mask,
                                       torch.arange(3).expand(2, 3), "sequence", cap=5.0)
    assert truncated.all() and torch.all(unit_w == 5.0)  # not 4.999999999999999
    iw, iw_truncated = behaviour_weight(torch.zeros(2, 3, dtype=DT), torch.full((2, 3), -4.0, dtype=DT), mask, 5.0)
    assert iw_truncated.all() and torch.all(iw == 5.0)
    inf_w, _, inf_truncated = prp_weights(torch.zeros(1, 2, dtype=DT), torch.full((1, 2), -400.0, dtype=DT),
                                          torch.ones(1, 2, dtype=DT), torch.arange(2)[None], "sequence", float("inf"))
    assert torch.isfinite(inf_w).all() and not inf_truncated.any()


def test_xgrpo_counts_groups_whose_baseline_fell_back_to_own_rewards():
    G, T = 2, 3
    logp = torch.zeros(2 * G, T, dtype=DT, requires_grad=True)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    group = torch.tensor([0, 0, 1, 1])
    peer = torch.zeros(1, T, dtype=DT)  # one peer reward, on group 1 only
    b = make_batch(logp, logp.detach(), torch.ones(2 * G, T, dtype=DT), rewards, group, 2, peer_logp=peer,
                   peer_behav=peer, peer_mask=torch.ones(1, T, dtype=DT), peer_rewards=torch.tensor([1.0], dtype=DT),
                   peer_group=torch.tensor([1]))
    for cfg in (XGRPOConfig(), XGRPOConfig(leave_own_out=True)):
        _, stats = compute_loss(b, cfg, rng())
        assert stats["baseline_fallback_groups"] == 1.0 and stats["baseline_fallback_frac"] == 0.5
        assert stats["peer_reward_groups"] == 1.0
