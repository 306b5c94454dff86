"""HACPO's invariants (policies/hacpo.py): GRPO when no peer sample arrives, finite and bounded weights, the
discrepancy coefficient moving the way its paper says, the clamp's zero gradient outside the cross bounds, the
capability-weighted baseline, and the engine's capability window."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from enginerun import Run

from engine.train.capability import CapabilityWindow
from policies.batch import ObjectiveBatch
from policies.hacpo import hacpo_advantages
from policies.objective_config import GRPOConfig, HACPOConfig
from policies.objectives import compute_loss

DT = torch.float64


def rng() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def batch(seed: int = 0, *, B: int = 8, P: int = 8, T: int = 5, Q: int = 2, peer_shift: float = 0.0,
          own_cap: float | None = None, peer_cap: float | None = None) -> ObjectiveBatch:
    """B own and P peer rows over Q prompts, on-policy own samples, peers whose source log-probs sit
    ``peer_shift`` nats a token below the receiver's (so the cross ratio is exp(peer_shift))."""
    g = torch.Generator().manual_seed(seed)
    logp = (-2 * torch.rand(B, T, generator=g, dtype=DT)).requires_grad_()
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(DT)
    peer_logp = (-2 * torch.rand(P, T, generator=g, dtype=DT)).requires_grad_()
    peer_mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (P,), generator=g)[:, None]).to(DT)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0] * (B // 4), dtype=DT)  # each prompt: two of four solved
    peer_rewards = torch.tensor([1.0, 1.0, 0.0, 1.0] * (P // 4), dtype=DT)
    b = ObjectiveBatch(
        logp=logp, behav_logp=logp.detach(), prox_logp=None, mask=mask, rewards=rewards,
        group=torch.arange(B) % Q, staleness=torch.zeros(B, dtype=torch.long), verified=rewards > 0, num_groups=Q,
        peer_logp=peer_logp, peer_behav_logp=peer_logp.detach() - peer_shift, peer_mask=peer_mask,
        peer_rewards=peer_rewards, peer_group=torch.arange(P) % Q, peer_verified=peer_rewards > 0,
        peer_residual=torch.zeros(P, dtype=DT), peer_align=torch.where(peer_mask > 0, torch.arange(T), -1),
        peer_source_len=peer_mask.sum(dim=1).long())
    if own_cap is not None:
        b.own_capability, b.peer_capability = own_cap, torch.full((P,), peer_cap, dtype=DT)
    return b


def no_peers(b: ObjectiveBatch) -> ObjectiveBatch:
    T = b.logp.shape[1]
    return dataclasses.replace(b, **ObjectiveBatch.empty_peers(T, dtype=DT), peer_source_len=None,
                               peer_capability=None)


def test_without_peer_samples_it_is_grpo_with_a_sequence_ratio():
    """No peer arrives: GSPO on own samples with GRPO's advantages (mean-only: exactly GRPO at seq_mean)."""
    b = no_peers(batch())
    got, _ = compute_loss(b, HACPOConfig(std_normalise=False), rng())
    want, _ = compute_loss(b, GRPOConfig(std_normalise=False, aggregation="seq_mean"), rng())
    (g_got,), (g_want,) = torch.autograd.grad(got, b.logp), torch.autograd.grad(want, b.logp)
    assert g_want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-14)
    # with the std: the recipe's unbiased one, so each group's advantages are GRPO's (population std) x sqrt((n-1)/n)
    adv = hacpo_advantages(b, HACPOConfig(), torch.ones(8, dtype=torch.bool), torch.zeros(0, dtype=torch.bool),
                           torch.zeros(0, dtype=DT)).own
    r = b.rewards
    for q in (0, 1):
        rows = b.group == q
        want_q = (r[rows] - r[rows].mean()) / (r[rows].std(unbiased=True) + 1e-6)
        torch.testing.assert_close(adv[rows], want_q)


@pytest.mark.parametrize("shift", [-30.0, -0.1, 0.0, 0.1, 30.0])
def test_each_peer_rows_gradient_is_the_clipped_ratio_to_the_power_one_plus_alpha_times_c_and_a(shift):
    """d loss / d (peer row's mean log pi) = -s_c ** (1 + alpha) * c * A / rows inside [lower, 1], 0 outside:
    finite and at most c_max * |A| whatever the log-probs."""
    cfg = HACPOConfig()
    b = batch(peer_shift=shift, own_cap=0.5, peer_cap=0.75)
    loss, stats = compute_loss(b, cfg, rng())
    (g,) = torch.autograd.grad(loss, b.peer_logp)
    assert torch.isfinite(g).all() and math.isfinite(stats["loss"])
    per_row = g.sum(dim=1)  # the gradient on the row's token mean (each token carries 1 / length of it)
    c = 0.75 / 0.5
    x = math.exp(max(min(shift, cfg.max_abs_log_ratio), -cfg.max_abs_log_ratio))
    inside = cfg.cross_clip_lower <= x <= 1.0
    adv = hacpo_advantages(b, cfg, torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool),
                           torch.full((8,), c, dtype=DT)).peer
    rows = 16
    want = -(x ** (1 + cfg.alpha)) * c * adv / rows if inside else torch.zeros_like(adv)
    torch.testing.assert_close(per_row, want, rtol=1e-9, atol=1e-15)
    assert per_row.abs().max() <= cfg.capability_max * adv.abs().max() / rows + 1e-12
    assert stats["cross_clipped_frac"] == (0.0 if inside else 1.0)


def test_a_stronger_peer_counts_more_and_a_weaker_one_less():
    """The discrepancy coefficient c = clip(P_peer / P_own, 0.1, 10) scales the peer rows' gradient."""
    def peer_grad(own_cap, peer_cap):
        b = batch(peer_shift=-0.1, own_cap=own_cap, peer_cap=peer_cap)  # cross ratio 0.905: inside the clip
        loss, stats = compute_loss(b, HACPOConfig(std_normalise=False), rng())
        return torch.autograd.grad(loss, b.peer_logp)[0].abs().sum(), stats["discrepancy_mean"]

    equal, c1 = peer_grad(0.4, 0.4)
    stronger, c2 = peer_grad(0.2, 0.8)
    weaker, c3 = peer_grad(0.8, 0.2)
    far, c4 = peer_grad(1e-6, 0.9)
    assert (c1, c2, c3, c4) == pytest.approx((1.0, 4.0, 0.25, 10.0))
    assert stronger > equal > weaker > 0 and far > stronger


def test_the_baseline_weighs_a_weaker_peers_successes_up_and_falls_back_past_one():
    """mu = mean of w r with w = 1 / c: a weaker peer's successes count P_own / P_peer times (E[w r] = P_own)."""
    cfg = HACPOConfig(std_normalise=False)
    one = torch.ones(2, dtype=torch.bool)
    b = ObjectiveBatch.solo(logp=torch.zeros(2, 1, dtype=DT), behav_logp=torch.zeros(2, 1, dtype=DT),
                            mask=torch.ones(2, 1, dtype=DT), rewards=torch.tensor([1.0, 0.0], dtype=DT),
                            group=torch.zeros(2, dtype=torch.long), num_groups=1)
    b = dataclasses.replace(b, peer_logp=torch.zeros(2, 1, dtype=DT), peer_behav_logp=torch.zeros(2, 1, dtype=DT),
                            peer_mask=torch.ones(2, 1, dtype=DT), peer_rewards=torch.tensor([1.0, 0.0], dtype=DT),
                            peer_group=torch.zeros(2, dtype=torch.long), peer_verified=torch.tensor([True, False]),
                            peer_residual=torch.zeros(2, dtype=DT), peer_align=torch.zeros(2, 1, dtype=torch.long))
    equal = hacpo_advantages(b, cfg, one, one, torch.ones(2, dtype=DT))
    weak = hacpo_advantages(b, cfg, one, one, torch.full((2,), 0.5, dtype=DT))  # peer half as capable
    assert equal.own.tolist() == pytest.approx([0.5, -0.5])  # mu = 2/4
    assert weak.own.tolist() == pytest.approx([0.25, -0.75])  # mu = (1 + 0 + 2 + 0) / 4
    guarded = hacpo_advantages(b, cfg, one, one, torch.full((2,), 0.1, dtype=DT))  # mu = (1 + 10) / 4 > 1
    assert guarded.guarded == 1 and guarded.own.tolist() == pytest.approx([0.5, -0.5])  # the own mean, 0.5


def test_an_all_equal_group_has_no_advantage_and_the_stats_are_finite():
    b = batch(own_cap=0.5, peer_cap=0.5)
    b.rewards.fill_(1.0)
    b.peer_rewards.fill_(1.0)
    loss, stats = compute_loss(b, HACPOConfig(), rng())
    assert float(loss.detach()) == 0.0 and all(math.isfinite(v) for v in stats.values())


def test_the_capability_window_averages_the_last_steps_of_each_model():
    class S:
        def __init__(self, reward, model=None):
            self.reward, self.model = reward, model

    w = CapabilityWindow(2)
    cap = w.update([S(1), S(0)], [S(1, "gemma")] * 4)
    assert cap.own == 0.5 and cap.peers == {"gemma": 1.0}
    cap = w.update([S(0), S(0)], [])  # gemma sent nothing: its window stays
    assert cap.own == pytest.approx((0.5 + 1e-8) / 2) and cap.peers == {"gemma": 1.0}
    cap = w.update([S(1), S(1)], [S(0, "gemma")])
    assert cap.own == pytest.approx((1e-8 + 1.0) / 2) and cap.peers == {"gemma": pytest.approx((1.0 + 1e-8) / 2)}


@pytest.mark.slow
def test_hacpo_trains_the_smoke_config_to_the_end(tmp_path, engine_cache):
    """The engine end to end: every peer sample crosses (correct or not), capabilities and ratios are finite."""
    run = Run(tmp_path / "run", engine_cache, "objective.kind='hacpo'", "train.steps=4")
    assert run.finish(timeout=900) == 0, run.out[-3000:]
    finals = {r["model"]: r for r in run.events("final")}
    assert {m: f["step"] for m, f in finals.items()} == {"gpt2": 4, "llama": 4}
    for model in finals:
        steps = run.steps(model)
        crossed = [s for s in steps if s["obj/peer_rows"] > 0]
        assert crossed, f"{model}: no peer sample reached its loss"
        assert any(not s["solo"] for s in steps)
        for s in crossed:
            assert 0.1 <= s["obj/discrepancy_mean"] <= 10.0 and 0.0 < s["obj/cross_ratio_mean"] <= math.exp(10)
            assert math.isfinite(s["obj/loss"]) and 0.0 <= s["obj/cross_clipped_frac"] <= 1.0
