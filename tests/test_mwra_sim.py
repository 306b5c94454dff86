"""MWRA cluster simulator (benchmarks/mwra_*): determinism, the oracle's exactness, the ratio claims."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import mwra_sim
from benchmarks.mwra_costs import MODELS, block_costs, decode_concurrency, generation_seconds, training_seconds
from benchmarks.mwra_oracle import best_static_split, brute_force_split, run_time
from benchmarks.mwra_simcore import Simulation, sim_config
from engine.schedule.controller import ControllerConfig, ModelLimits, initial_assignment


def _costs(workload: str, n: int, steps: int, seed: int = 0):
    cfg = sim_config(n, steps)
    return cfg, block_costs(workload, steps * cfg.train_batch_blocks, cfg.block_prompts, seed)


def test_same_seed_same_run():
    cfg, costs = _costs("drifting", 16, 300, seed=5)
    a = Simulation(cfg, costs, controller=mwra_sim.controller_config()).run()
    b = Simulation(cfg, costs, controller=mwra_sim.controller_config()).run()
    assert a.run_time_s == b.run_time_s and a.moves == b.moves and a.decisions == b.decisions
    assert a.moves > 0  # the controller really acted
    _, other = _costs("drifting", 16, 300, seed=6)
    assert not np.array_equal(other.gen["qwen3-8b"], costs.gen["qwen3-8b"])


def test_simulator_drives_the_real_controller():
    """With an unreachable threshold MWRA never moves, and then equals the static run of its first split."""
    cfg, costs = _costs("stationary", 12, 200)
    frozen = ControllerConfig(models=[ModelLimits(name=m.name, group_size=m.group_size) for m in MODELS],
                              improvement_threshold=1e9)
    mwra = Simulation(cfg, costs, controller=frozen).run()
    first = initial_assignment([f"w{i:03d}" for i in range(12)], frozen)
    counts: dict[str, int] = {}
    for role, model in first.values():
        counts[f"{role}:{model}"] = counts.get(f"{role}:{model}", 0) + 1
    static = Simulation(cfg, costs, static_counts=counts).run()
    assert mwra.moves == 0 and mwra.run_time_s == pytest.approx(static.run_time_s)


def test_every_block_is_trained_and_allocations_stay_legal():
    cfg, costs = _costs("drifting", 24, 300)
    res = Simulation(cfg, costs, controller=mwra_sim.controller_config()).run()
    per_block = cfg.block_prompts * sum(m.group_size for m in MODELS)
    assert res.useful_samples == 300 * cfg.train_batch_blocks * per_block
    for _, counts in res.timeline:
        assert sum(counts.values()) == 24
        assert all(counts.get(k, 0) >= 1 for k in mwra_sim.pool_keys())
    assert all(rec["kind"] == "mwra_decision" and rec["reasons"] for rec in res.decisions)
    json.dumps(res.decisions)


def test_oracle_search_is_exact():
    cfg, costs = _costs("drifting", 9, 100)
    C = mwra_sim.segment_costs(costs, 100 * cfg.train_batch_blocks)
    K = C.shape[1]
    lo, hi = np.ones(K, int), np.full(K, 9)
    split, t, _ = best_static_split(C, 9, lo, hi)
    brute, tb = brute_force_split(C, 9, lo, hi)
    assert t == pytest.approx(tb) and run_time(C, split) == pytest.approx(t)
    hi2 = np.array([2, 9, 9, 9, 2, 9])
    split2, t2, _ = best_static_split(C, 9, lo, hi2)
    assert (split2 <= hi2).all() and split2.sum() == 9
    assert t2 == pytest.approx(brute_force_split(C, 9, lo, hi2)[1])


def test_cost_model_shapes():
    """Longer responses decode fewer sequences at once and cost more per token; training is linear."""
    small, big = MODELS[0], MODELS[2]
    assert decode_concurrency(big, 5000) < decode_concurrency(big, 500) <= 256
    short, long_ = np.array([1000.0]), np.array([4000.0])
    assert generation_seconds(big, long_, 4000)[0] / 4000 > generation_seconds(big, short, 1000)[0] / 1000
    assert training_seconds(big, long_)[0] / training_seconds(small, long_)[0] == pytest.approx(
        big.params / small.params)


@pytest.mark.parametrize("workload,need", [("stationary", mwra_sim.STATIONARY_MIN_RATIO),
                                           ("drifting", mwra_sim.DRIFTING_MIN_RATIO)])
def test_ratio_claims_small_cluster(workload, need):
    case = mwra_sim.run_case(workload, 16, 1000, seed=1)
    assert case["oracle_static_throughput"] >= case["oracle_static_simulated"]
    assert case["ratio"] >= need, case


def test_benchmark_prints_json_last(tmp_path, capsys):
    fig = tmp_path / "alloc.png"
    assert mwra_sim.main(["--quick", "--figure", str(fig)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    for w in ("stationary", "drifting"):
        assert {"oracle_static_throughput", "mwra_throughput", "ratio"} <= set(out[w])
    assert out["passes"] and fig.stat().st_size > 10_000


def test_bad_cluster_size_is_one_sentence(capsys):
    assert mwra_sim.main(["--sizes", "4"]) == 2
    assert "between 8 and 512" in capsys.readouterr().err
