"""MWRA policy (engine.controller, engine.allocation): pure-function tests on built Stats."""

from __future__ import annotations

import itertools
import json
import math

import msgspec
import numpy as np
import pytest

from engine.schedule.allocation import bottleneck_rate, max_min_counts, plan_moves, pool_key
from engine.schedule.controller import (ClusterView, ControllerConfig, ControllerState, ModelLimits, decide,
                               initial_assignment, view_from_stats)
from exchange.protocol import SCHEMA_VERSION, Assign, Stats

GEN, LRN = "generator", "learner"


def config(**kw) -> ControllerConfig:
    models = kw.pop("models", [ModelLimits(name="a", group_size=4), ModelLimits(name="b", group_size=4)])
    return ControllerConfig(models=models, **kw)


def split(counts: dict[tuple[str, str], int]) -> dict[str, tuple[str, str]]:
    ids = (f"w{i:02d}" for i in itertools.count())
    return {next(ids): rm for rm, n in sorted(counts.items()) for _ in range(n)}


def stats_for(assignment, cap: dict[tuple[str, str], float], now: float, rng=None, noise=0.0,
              idle: dict[tuple[str, str], float] | None = None) -> list[Stats]:
    """Stats a worker would send if one busy worker of its pool does cap[(role, model)] samples/s."""
    out = []
    for w, (role, model) in assignment.items():
        busy = 1.0 - (idle or {}).get((role, model), 0.1)
        rate = cap[(role, model)] * busy * (1 + (noise * rng.standard_normal() if rng is not None else 0.0))
        kw = {"samples_per_s": rate} if role == GEN else {"consumed_per_s": rate, "queue_depth": 8}
        out.append(Stats(schema=SCHEMA_VERSION, worker_id=w, role=role, model=model, time=now, window_s=60.0,
                         idle_frac=1.0 - busy, **kw))
    return out


def step(assignment, cap, cfg, state, now, **kw):
    view = view_from_stats(stats_for(assignment, cap, now, **kw), assignment, now, cfg)
    d = decide(view, state, cfg)
    new = dict(assignment)
    new.update(d.assignments)
    return new, d


def counts_of(assignment) -> dict[tuple[str, str], int]:
    out: dict = {}
    for rm in assignment.values():
        out[rm] = out.get(rm, 0) + 1
    return out


# Pool capacities in samples/s per busy worker; with G = 4: a-gen 2, a-lrn 1, b-gen 0.5, b-lrn 1 prompts/s.
CAP = {(GEN, "a"): 8.0, (LRN, "a"): 4.0, (GEN, "b"): 2.0, (LRN, "b"): 4.0}
BALANCED = {(GEN, "a"): 2, (LRN, "a"): 4, (GEN, "b"): 8, (LRN, "b"): 4}  # every pool: 4 prompts/s


def test_does_nothing_when_balanced():
    cfg = config()
    a = split(BALANCED)
    new, d = step(a, CAP, cfg, ControllerState(), 100.0)
    assert not d.acted and d.assignments == {} and new == a
    assert any("balanced" in r for r in d.reasons)
    assert d.predicted_before == pytest.approx(4.0, rel=1e-9)


def test_matches_rates_on_imbalanced_input():
    cfg = config(max_move_frac=1.0)
    a = split({(GEN, "a"): 5, (LRN, "a"): 5, (GEN, "b"): 3, (LRN, "b"): 5})  # b's generators starve everyone
    new, d = step(a, CAP, cfg, ControllerState(), 100.0)
    assert d.acted
    assert counts_of(new) == BALANCED
    assert d.predicted_before == pytest.approx(1.5) and d.predicted_after == pytest.approx(4.0)
    assert d.counts_after == {pool_key(r, m): n for (r, m), n in BALANCED.items()}
    rec = d.to_record()
    assert json.loads(json.dumps(rec))["kind"] == "mwra_decision"
    assert rec["assignments"] and all(isinstance(v, list) for v in rec["assignments"].values())
    msgs = d.to_assign_messages()
    assert {(m.worker_id, m.role, m.model) for m in msgs} == {(w, *rm) for w, rm in d.assignments.items()}
    assert all(isinstance(m, Assign) and m.epoch == d.epoch == 1 for m in msgs)


def test_moves_are_capped_per_decision_and_converge():
    cfg = config(max_move_frac=0.25, cooldown_s=0.0, min_dwell_s=0.0, decision_interval_s=60.0)
    a = split({(GEN, "a"): 5, (LRN, "a"): 5, (GEN, "b"): 3, (LRN, "b"): 5})
    state, t = ControllerState(), 0.0
    for _ in range(6):
        t += 60.0
        a, d = step(a, CAP, cfg, state, t)
        state = d.new_state
        assert len(d.assignments) <= 4
    assert counts_of(a) == BALANCED


def test_min_and_max_are_honoured():
    models = [ModelLimits(name="a", group_size=4, min_learners=5),
              ModelLimits(name="b", group_size=4, max_generators=5)]
    cfg = config(models=models, max_move_frac=1.0)
    a = split({(GEN, "a"): 5, (LRN, "a"): 5, (GEN, "b"): 3, (LRN, "b"): 5})
    new, d = step(a, CAP, cfg, ControllerState(), 100.0)
    c = counts_of(new)
    assert c[(LRN, "a")] >= 5 and c[(GEN, "b")] <= 5
    assert c[(GEN, "b")] == 5  # as many as allowed: b's generators are the bottleneck
    assert sum(c.values()) == len(a)


def test_violated_minimum_is_restored_even_inside_the_interval():
    models = [ModelLimits(name="a", group_size=4, min_generators=3), ModelLimits(name="b", group_size=4)]
    cfg = config(models=models)
    a = split({(GEN, "a"): 1, (LRN, "a"): 4, (GEN, "b"): 8, (LRN, "b"): 5})
    state = ControllerState(last_decision_at=99.0, last_move_at=99.0)
    new, d = step(a, CAP, cfg, state, 100.0)
    assert d.acted and counts_of(new)[(GEN, "a")] == 3
    assert any("restore limits" in r for r in d.reasons)


def test_no_thrash_under_noisy_stats_around_balance():
    cfg = config(decision_interval_s=60.0)
    a = split(BALANCED)
    state, rng, moves = ControllerState(), np.random.default_rng(7), 0
    for i in range(1, 301):  # five hours of one-minute windows, +-10% noise per worker
        a, d = step(a, CAP, cfg, state, 60.0 * i, rng=rng, noise=0.10)
        state = d.new_state
        moves += len(d.assignments)
    assert moves == 0 and counts_of(a) == BALANCED


def test_dwell_keeps_a_moved_worker_in_place_when_stats_flip():
    cfg = config(max_move_frac=1.0, cooldown_s=0.0, min_dwell_s=900.0, decision_interval_s=60.0)
    a = split({(GEN, "a"): 5, (LRN, "a"): 5, (GEN, "b"): 3, (LRN, "b"): 5})
    a, d = step(a, CAP, cfg, ControllerState(), 60.0)
    moved = set(d.assignments)
    flipped = {(GEN, "a"): 2.0, (LRN, "a"): 4.0, (GEN, "b"): 8.0, (LRN, "b"): 4.0}  # now a's generators starve
    state = d.new_state
    for t in (120.0, 180.0, 240.0):
        a, d = step(a, flipped, cfg, state, t)
        state = d.new_state
        assert not moved & set(d.assignments)
    assert counts_of(a)[(GEN, "a")] > 2  # it still helped, with workers that were free to move


def test_capacity_uses_busy_time_not_observed_rate():
    """A pool throttled by its peers (mostly idle) must not look slow."""
    cfg = config()
    a = split(BALANCED)
    idle = {(GEN, "a"): 0.6, (LRN, "a"): 0.1, (GEN, "b"): 0.05, (LRN, "b"): 0.5}
    view = view_from_stats(stats_for(a, CAP, 100.0, idle=idle), a, 100.0, cfg)
    d = decide(view, ControllerState(), cfg)
    assert d.prompts_per_s_worker[pool_key(GEN, "a")] == pytest.approx(2.0)
    assert d.prompts_per_s_worker[pool_key(LRN, "b")] == pytest.approx(1.0)
    assert not d.acted


def test_view_ignores_switching_stale_and_unknown_workers():
    cfg = config()
    a = split(BALANCED)
    s = stats_for(a, CAP, 1000.0)
    w0 = next(iter(a))
    s[0] = msgspec.structs.replace(s[0], role=LRN, model="b")  # still reporting its old role: switching
    s[1] = msgspec.structs.replace(s[1], time=1.0)  # stale
    s.append(Stats(schema=SCHEMA_VERSION, worker_id="broker", role="broker", model="", time=1000.0, window_s=60.0))
    view = view_from_stats(s, a, 1000.0, cfg)
    assert sum(p.reporting for p in view.pools.values()) == len(a) - 2
    assert w0 in view.pools[pool_key(*a[w0])].workers


def test_every_stats_window_counts_once():
    """The view sums every window it is given (two from one worker count twice), and a call
    with no new windows leaves the estimates alone: an idle worker's last report must not
    keep speaking for its pool after the workload changed."""
    cfg = config(decision_interval_s=1.0, ewma_halflife_s=4.0, min_busy_s=1.0)
    a = split(BALANCED)
    w = next(w for w, rm in a.items() if rm == (GEN, "a"))

    def mk(t, rate):
        return Stats(schema=SCHEMA_VERSION, worker_id=w, role=GEN, model="a", time=t, window_s=2.0,
                     samples_per_s=rate, idle_frac=0.5)

    view = view_from_stats([mk(99.0, 2.0), mk(100.0, 6.0)], a, 100.0, cfg)
    p = view.pools[pool_key(GEN, "a")]
    assert (p.reporting, p.done, p.busy_s, p.window_s) == (1, 16.0, 2.0, 4.0)

    d = decide(view_from_stats(stats_for(a, CAP, 100.0), a, 100.0, cfg), ControllerState(), cfg)
    before = d.prompts_per_s_worker[pool_key(GEN, "a")]
    d2 = decide(view_from_stats([], a, 130.0, cfg), d.new_state, cfg)  # nobody finished anything since
    assert d2.prompts_per_s_worker[pool_key(GEN, "a")] == before
    # one worker now reports a 4x cost; the others are silent (idle): the estimate follows the new report
    slow = [x for x in stats_for(a, {**CAP, (GEN, "a"): CAP[(GEN, "a")] / 4}, 140.0) if x.worker_id == w]
    d3 = decide(view_from_stats(slow, a, 140.0, cfg), d2.new_state, cfg)
    assert d3.prompts_per_s_worker[pool_key(GEN, "a")] == pytest.approx(before / 4, rel=0.02)


def test_waits_for_an_estimate_of_every_pool():
    cfg = config()
    a = split(BALANCED)
    s = [x for x in stats_for(a, CAP, 100.0) if x.role == GEN]
    d = decide(view_from_stats(s, a, 100.0, cfg), ControllerState(), cfg)
    assert not d.acted and "waiting for busy time" in d.reasons[0]
    assert math.isnan(d.predicted_before) and d.to_record()["predicted_before"] is None


def test_a_seldom_busy_pool_adds_up_its_busy_time_across_calls():
    """A cheap model's learners are busy ~10% of the time: no single call's windows reach
    min_busy_s, but together they do, and the estimate is their pooled rate. Evidence older
    than stale_stats_s is dropped instead of pooled with new."""
    cfg = config(decision_interval_s=1.0, min_busy_s=2.0, stale_stats_s=20.0)
    a = split(BALANCED)
    key = pool_key(LRN, "b")
    w = next(w for w, rm in a.items() if rm == (LRN, "b"))

    def mk(t, rate):
        return Stats(schema=SCHEMA_VERSION, worker_id=w, role=LRN, model="b", time=t, window_s=1.0,
                     consumed_per_s=rate, idle_frac=0.9)  # 0.1 s busy a window

    state = ControllerState()
    for t in range(100, 119):  # 19 windows: 1.9 s busy, short of 2 s
        state = decide(view_from_stats([mk(float(t), 0.4 if t % 2 else 0.8)], a, float(t), cfg), state, cfg).new_state
        assert key not in state.capacity
    d = decide(view_from_stats([mk(119.0, 0.4)], a, 119.0, cfg), state, cfg)
    # done = 10 windows * 0.4 + 10 * 0.8 = 12 samples in 2 s busy
    assert d.new_state.capacity[key] == pytest.approx(6.0) and key not in d.new_state.pending
    # 1.5 s of busy time, then a gap longer than stale_stats_s: the old 1.5 s no longer counts
    state = d.new_state
    for t in range(120, 135):
        state = decide(view_from_stats([mk(float(t), 100.0)], a, float(t), cfg), state, cfg).new_state
    assert state.pending[key][1] == pytest.approx(1.5)
    state = decide(view_from_stats([mk(160.0, 0.8)], a, 160.0, cfg), state, cfg).new_state
    assert state.pending[key][:2] == pytest.approx((0.8, 0.1)) and state.capacity[key] == pytest.approx(6.0)


def test_flooded_learner_queue_adds_drain_demand():
    cfg = config(flood_queue_s=60.0, drain_horizon_s=60.0, max_move_frac=1.0)
    a = split(BALANCED)
    s = [msgspec.structs.replace(x, queue_depth=4 * 600) if (x.role, x.model) == (LRN, "b") else x
         for x in stats_for(a, CAP, 100.0)]
    d = decide(view_from_stats(s, a, 100.0, cfg), ControllerState(), cfg)
    assert d.acted and any("flooded" in r for r in d.reasons)
    assert d.counts_after[pool_key(LRN, "b")] > 4


def test_initial_assignment_and_config_errors():
    cfg = config()
    a = initial_assignment([f"w{i}" for i in range(10)], cfg)
    assert sorted(counts_of(a).values()) == [2, 2, 3, 3]
    with pytest.raises(msgspec.ValidationError, match=r"models\[0\].min_learners"):
        ControllerConfig.from_dict({"models": [{"name": "a", "min_learners": 0}]})
    with pytest.raises(msgspec.ValidationError, match="exceeds max_generators"):
        ControllerConfig.from_dict({"models": [{"name": "a", "min_generators": 4, "max_generators": 2}]})
    with pytest.raises(msgspec.ValidationError, match="unknown field `typo`"):
        ControllerConfig.from_dict({"models": [{"name": "a"}], "typo": 1})
    with pytest.raises(msgspec.ValidationError, match="repeat"):
        ControllerConfig.from_dict({"models": [{"name": "a"}, {"name": "a"}]})


def test_max_min_counts_is_optimal_against_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(40):
        keys = ["p0", "p1", "p2", "p3"]
        cap = {k: float(rng.uniform(0.2, 3.0)) for k in keys}
        lo = {k: int(rng.integers(1, 3)) for k in keys}
        hi = {k: lo[k] + int(rng.integers(0, 6)) for k in keys}
        total = int(rng.integers(sum(lo.values()), sum(hi.values()) + 3))
        got = max_min_counts(cap, total, lo, hi)
        best = max(bottleneck_rate(dict(zip(keys, n)), cap)
                   for n in itertools.product(*(range(lo[k], hi[k] + 1) for k in keys)) if sum(n) <= total)
        assert bottleneck_rate(got, cap) == pytest.approx(best)
        assert all(lo[k] <= got[k] <= hi[k] for k in keys) and sum(got.values()) <= total


def test_plan_moves_respects_movable_and_budget():
    cur = {"x": 6, "y": 2, "z": 2}
    target = {"x": 2, "y": 4, "z": 4}
    cap = {"x": 1.0, "y": 1.0, "z": 1.0}
    assert len(plan_moves(cur, target, cap, {"x": 6}, max_moves=3)) == 3
    assert plan_moves(cur, target, cap, {"x": 1}, max_moves=10) == [("x", "y")]
    assert plan_moves(cur, target, cap, {"y": 2}, max_moves=10) == []


def test_assign_messages_survive_the_wire():
    cfg = config(max_move_frac=1.0)
    a = split({(GEN, "a"): 5, (LRN, "a"): 5, (GEN, "b"): 3, (LRN, "b"): 5})
    _, d = step(a, CAP, cfg, ControllerState(), 100.0)
    for msg in d.to_assign_messages():
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=Assign)
        assert back == msg and back.reason
    assert isinstance(view_from_stats([], a, 0.0, cfg), ClusterView)


def test_a_group_leader_is_never_moved_and_a_joiner_keeps_its_dwell():
    """Learners of a: w0 leads, w1 joined a second ago. MWRA wants one learner of a fewer: the leader keeps its
    role (its group's state is its) and the joiner is inside its dwell time, so nobody moves; once the joiner has
    dwelt, it is the one that moves."""
    cfg = config(max_move_frac=1.0, cooldown_s=0.0, min_dwell_s=15.0, decision_interval_s=1.0)
    a = {"w0": (LRN, "a"), "w1": (LRN, "a"), "w2": (GEN, "a"), "w3": (GEN, "b"), "w4": (LRN, "b")}
    cap = {(GEN, "a"): 1.0, (LRN, "a"): 40.0, (GEN, "b"): 40.0, (LRN, "b"): 40.0}  # a's generators limit the run
    state = ControllerState(moved_at={"w1": 99.0, "w2": 0.0, "w3": 0.0, "w4": 0.0})
    view = view_from_stats(stats_for(a, cap, 100.0), a, 100.0, cfg, leaders=["w0", "w4"])
    d = decide(view, state, cfg)
    assert "w0" not in d.assignments and "w1" not in d.assignments, d.assignments
    view = view_from_stats(stats_for(a, cap, 120.0), a, 120.0, cfg, leaders=["w0", "w4"])
    d = decide(view, d.new_state, cfg)
    assert d.assignments.get("w1") == (GEN, "a"), (d.assignments, d.reasons)
    assert "w0" not in d.assignments and "w4" not in d.assignments
