"""The contextual-bandit analysis: the paper's three facts, exactness, and agreement with the objectives."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import bandit as bench
from benchmarks.bandit_model import (
    Bandit,
    Hyper,
    analyse,
    ascent_direction,
    enumerate_outcomes,
    gradient_moments,
    paper_bandit,
    rare_success_arms,
    success_rate,
)
from policies.objectives import GRPOConfig, ObjectiveBatch, PRPConfig, SGTConfig, XGRPOConfig, compute_loss


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; extra threads only contend on a busy box
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reports():
    torch.set_num_threads(1)
    return analyse(paper_bandit(), steps=150, replicas=8, seed=0)


def test_prp_has_the_highest_gradient_variance(reports):
    prp = reports["prp"].grad_variance
    for method in ("grpo", "xgrpo", "sgt"):
        assert prp > 2.0 * reports[method].grad_variance, (method, prp, reports[method].grad_variance)
    assert reports["prp"].w_var > 10.0


def test_xgrpo_gains_nothing_on_arms_the_receiver_never_samples(reports):
    assert reports["xgrpo"].support_gain_never == 0.0
    assert reports["grpo"].support_gain_never == 0.0
    # Where the receiver samples them with p ~ 5e-7, the gain is of that order: 1e-4 of SGT's or less.
    assert abs(reports["xgrpo"].support_gain) < 1e-4 * reports["sgt"].support_gain


def test_sgt_puts_positive_mass_on_the_peer_success_arm_when_own_success_is_near_zero(reports):
    bandit = paper_bandit()
    own_success = success_rate(bandit, bandit.receiver_logits)
    assert own_success[0] < 1e-5  # context 0: the receiver essentially never succeeds
    assert reports["sgt"].support_gain > 0.1 and reports["sgt"].support_gain_never > 0.1
    # ... and that is what solves the rescue prompt when the update is iterated.
    assert reports["sgt"].rescue_success > 0.9
    assert all(reports[m].rescue_success < 0.6 for m in ("grpo", "xgrpo", "prp"))


def test_truncation_trades_variance_for_bias_and_only_prp_pays_the_residual(reports):
    caps = ["prp", "prp_c10", "prp_c5", "prp_c2"]
    variances = [reports[c].grad_variance for c in caps]
    biases = [reports[c].truncation_bias for c in caps]
    assert variances == sorted(variances, reverse=True) and biases == sorted(biases)
    assert all(reports[c].residual_bias > 0.01 for c in caps)
    assert all(reports[m].residual_bias == 0.0 for m in ("grpo", "xgrpo", "sgt"))


def test_enumeration_is_exact():
    bandit = paper_bandit()
    theta = bandit.receiver_logits
    out = enumerate_outcomes(bandit, theta)
    assert out.own.shape[0] == 4 ** 6 and torch.allclose(out.prob.sum(-1), torch.ones(4, dtype=torch.float64))
    # Monte Carlo with a fixed seed agrees with the exact mean to within its standard error.
    gen = torch.Generator().manual_seed(1)
    draws = 20000
    mu = bandit.peer_logits.softmax(-1)
    own = torch.multinomial(theta.softmax(-1), draws * 3, replacement=True, generator=gen).view(4, draws, 3).transpose(0, 1)
    peer = torch.multinomial(mu, draws * 3, replacement=True, generator=gen).view(4, draws, 3).transpose(0, 1)
    for method in ("xgrpo", "sgt"):
        exact = gradient_moments(method, bandit, theta, Hyper(), out)
        u = ascent_direction(method, bandit, theta.expand(draws, 4, 4), own, peer, Hyper())
        err = (u.mean(0) - exact.mean).abs().max()
        assert err < 5 * math.sqrt(float(exact.variance.max()) / draws)
        assert abs(float(((u - u.mean(0)) ** 2).sum(-1).mean(0).sum()) / float(exact.variance.sum()) - 1) < 0.05


def _single_token_batch(bandit: Bandit, theta: torch.Tensor, k: int, own, peer) -> ObjectiveBatch:
    log_pi = theta.log_softmax(-1)[k]
    log_mu_hat = bandit.peer_logits.log_softmax(-1)[k] + bandit.residual[k]
    reward = bandit.reward[k]
    G, P = len(own), len(peer)
    own_logp = log_pi[own][:, None]
    return ObjectiveBatch(
        logp=own_logp, behav_logp=own_logp.detach(), prox_logp=None, mask=torch.ones(G, 1, dtype=theta.dtype),
        rewards=reward[own], group=torch.zeros(G, dtype=torch.long), staleness=torch.zeros(G, dtype=torch.long),
        verified=reward[own] > 0, num_groups=1, peer_logp=log_pi[peer][:, None], peer_behav_logp=log_mu_hat[peer][:, None],
        peer_mask=torch.ones(P, 1, dtype=theta.dtype), peer_rewards=reward[peer], peer_group=torch.zeros(P, dtype=torch.long),
        peer_verified=reward[peer] > 0, peer_residual=torch.zeros(P, dtype=theta.dtype), peer_align=torch.zeros(P, 1, dtype=torch.long),
    )


@pytest.mark.parametrize("method, config, hyper", [
    ("grpo", GRPOConfig(), Hyper()),
    ("xgrpo", XGRPOConfig(), Hyper()),
    ("prp", PRPConfig(ratio_cap=2.0), Hyper(ratio_cap=2.0)),
    ("prp", PRPConfig(ratio_cap=float("inf"), variant="token"), Hyper(ratio_cap=float("inf"))),
    ("sgt", SGTConfig(lam=0.1), Hyper(sgt_lambda=0.1)),
])
def test_bandit_update_is_the_objectives_gradient(method, config, hyper):
    bandit = paper_bandit()
    gen = torch.Generator().manual_seed(2)
    theta = bandit.receiver_logits.clone()
    draws = [(torch.randint(0, 4, (4, 3), generator=gen), torch.randint(0, 4, (4, 3), generator=gen)) for _ in range(6)]
    draws.append((torch.tensor([[0, 1, 2]] * 4), torch.tensor([[3, 3, 0]] * 4)))  # context 0: own fail, two peer wins
    for own, peer in draws:
        u = ascent_direction(method, bandit, theta, own, peer, hyper)  # (K, N)
        for k in range(4):
            options = []
            for seed in range(8 if method == "sgt" else 1):  # SGT draws one success uniformly: collect its picks
                leaf = theta.clone().requires_grad_()
                loss, _ = compute_loss(_single_token_batch(bandit, leaf, k, own[k], peer[k]), config, torch.Generator().manual_seed(seed))
                options.append(-torch.autograd.grad(loss, leaf)[0][k])
            if method != "sgt":
                assert torch.allclose(options[0], u[k], atol=1e-10), (own[k], peer[k], options[0], u[k])
                continue
            wins = [j for j in range(3) if bandit.reward[k, peer[k, j]] > 0]
            base = ascent_direction("grpo", bandit, theta, own, peer, hyper)[k]
            rescue = bool(bandit.reward[k, own[k]].sum() == 0) and bool(wins)
            score = [torch.nn.functional.one_hot(peer[k, j], 4).double() - theta[k].softmax(-1) for j in wins]
            allowed = [base + 0.1 * s for s in score] if rescue else [base]
            assert all(any(torch.allclose(o, a, atol=1e-10) for a in allowed) for o in options)
            assert torch.allclose(sum(allowed) / len(allowed), u[k], atol=1e-10)


def test_rare_arms_are_the_peer_only_successes():
    rare = rare_success_arms(paper_bandit(), 1e-3)
    assert rare.nonzero().tolist() == [[0, 3], [2, 3]]


def test_benchmark_prints_table_plot_and_json(tmp_path, capsys):
    out = tmp_path / "plot.png"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert out.stat().st_size > 10_000
    assert any(line.startswith("prp ") for line in lines[:-1])
    for method in ("grpo", "xgrpo", "prp", "sgt"):
        assert set(summary["methods"][method]) >= {"grad_norm", "grad_variance", "support_gain", "final_success"}
    facts = summary["facts"]
    assert facts["prp_highest_variance"] and facts["xgrpo_no_gain_on_unsampled_arms"] and facts["sgt_positive_gain_toward_peer_success"]


def test_benchmark_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--steps", "0"])
    assert exc.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
