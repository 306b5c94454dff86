"""Workers that change role while the run goes, for real: configs/pool.toml's models, gloo groups, the
exchange, the weight channel. Scripted moves fire on events (a model's learner reaching a step).
Nothing may be lost, every hand-over is exact, and every role switch gives memory back first."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys

import pytest
from enginerun import ROOT, Run
from poolsetup import script, static_pool

from exchange.log import ExperienceLogReader

pytestmark = pytest.mark.slow
POOL = "configs/pool.toml"


def _pool_run(tmp_path, cache, *sets: str) -> Run:
    return Run(tmp_path / "run", cache, *sets, config=POOL)


def _bits_exact(result: dict, records: list[dict], worker: str, model: str) -> list[dict]:
    """The generator_weights records of ``worker`` for ``model``, each checked against the learner's step digest."""
    published = {(r["model"], r["weight_version"]): r["params_digest"] for r in records if r.get("event") == "step"}
    used = [r for r in records if r.get("event") == "generator_weights" and r["worker"] == worker
            and r["gen_model"] == model]
    for r in used:
        if r["weight_version"] > 0:
            assert r["params_digest"] == published[model, r["weight_version"]], r
    return used


def test_generator_and_learner_rank_reassigned_mid_run(tmp_path, engine_cache):
    """Over pair groups (``pool.weights=broadcast``): a mover's pair groups form and close as it changes role.
    The same moves on the channel (the default on CPUs): test_role_switches_release_before_they_acquire."""
    # static split in pool-key order: w0,w1 generate gpt2, w2 llama, w3 learns gpt2, w4 llama
    run = _pool_run(tmp_path, engine_cache, *static_pool(5, 14, (2, 1, 1, 1)), "pool.weights=broadcast",
                    script(("gpt2", 3, "w1", "learner", "gpt2"),  # generator -> learner rank
                           ("gpt2", 7, "w1", "generator", "llama")))  # learner rank -> the other model
    assert run.finish() == 0, run.out[-3000:]
    result, records = run.result(), run.records()
    assert result["audit"]["logged"] > 0
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert result["moves"] == 2 and result["regroups"] == 2
    # a step's prompts go out one per unit: both gpt2 generators share steps, each prompt from one generator
    by_step, by_prompt = collections.defaultdict(set), collections.defaultdict(set)
    for exp in ExperienceLogReader(run.run_dir / "experience_log"):
        maker = exp.experience_id.rsplit("/", 1)[1]
        by_prompt[(exp.model, exp.prompt_id)].add(maker)
        if exp.model == "gpt2":
            by_step[exp.prompt_id // 4].add(maker)
    assert any(len(m) > 1 for m in by_step.values())
    assert all(len(m) == 1 for m in by_prompt.values())
    gpt2 = [f for f in result["formations"] if f["model"] == "gpt2"]
    assert [f["epoch"] for f in gpt2] == [1, 2, 3]
    assert sorted(gpt2[1]["digests"]) == ["w1", "w3"]  # the joiner formed with the leader ...
    for f in result["formations"]:  # ... and every rank of every formation holds rank 0's exact state
        assert len(set(f["digests"].values())) == 1, f
    assert 3 <= gpt2[1]["step"] < gpt2[2]["step"] < result["steps"]["gpt2"]  # the step count carried on
    assigns = [r for r in records if r.get("event") == "assign"]
    assert [r["changes"] for r in assigns] == [{"w1": ["learner", "gpt2"]}, {"w1": ["generator", "llama"]}]
    assert all(r["reason"].startswith("scripted move at gpt2 step") for r in assigns)
    used = _bits_exact(result, records, "w1", "llama")  # the mover runs llama's published weights, bit for bit
    assert used and used[0]["weight_version"] > 0
    assert run.leftover() == []


def test_role_switches_release_before_they_acquire(tmp_path, engine_cache):
    # static split in pool-key order: w0 generates gpt2, w1 llama, w2 learns gpt2, w3 (leader) + w4 llama
    run = _pool_run(tmp_path, engine_cache, *static_pool(5, 16, (1, 1, 1, 2)),
                    script(("llama", 2, "w4", "generator", "gpt2"),  # a non-leader rank leaves
                           ("llama", 4, "w0", "learner", "gpt2"),  # generator -> learner, same model
                           ("llama", 6, "w0", "generator", "llama"),  # learner -> the other model
                           ("llama", 6, "w1", "generator", "gpt2"),  # generator -> generator
                           ("llama", 8, "w4", "learner", "llama")))  # ... and the rank rejoins its group
    assert run.finish() == 0, run.out[-3000:]
    result, records = run.result(), run.records()
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    switches = {(r["worker"], r["from_role"], r["from_model"], r["to_role"], r["to_model"]): r
                for r in records if r.get("event") == "role_switch"}
    assert sorted(switches) == sorted([
        ("w4", "learner", "llama", "generator", "gpt2"), ("w0", "generator", "gpt2", "learner", "gpt2"),
        ("w0", "learner", "gpt2", "generator", "llama"), ("w1", "generator", "llama", "generator", "gpt2"),
        ("w4", "generator", "gpt2", "learner", "llama")])
    module = switches["w4", "learner", "llama", "generator", "gpt2"]["held_bytes_after_acquire"]
    near = lambda a, b: abs(a - b) <= 64  # noqa: E731  a generator's weights may be a view of a channel slot
    for (_, _, old, _, new), r in switches.items():
        assert r["held_bytes_before"] > 0 and r["released_alive"] == 0, r
        assert r["held_bytes_after_acquire"] > r["held_bytes_after_release"], r
        if old == new:  # only the module stays, without its gradients
            assert r["reused"] == [f"module:{old}"] and near(r["held_bytes_after_release"], module), r
        else:
            assert r["reused"] == [] and r["held_bytes_after_release"] == 0, r
    # a learner's memory (weights, moments) is several times its module's; a generator holds the module only
    assert switches["w0", "generator", "gpt2", "learner", "gpt2"]["held_bytes_after_acquire"] >= 3 * (module - 64)
    assert near(switches["w1", "generator", "llama", "generator", "gpt2"]["held_bytes_after_acquire"], module)
    llama = [f for f in result["formations"] if f["model"] == "llama"]
    assert [sorted(f["digests"]) for f in llama] == [["w3", "w4"], ["w3"], ["w3", "w4"]]
    assert 0 < llama[2]["step"] and llama[2]["digests"]["w4"] == llama[2]["digests"]["w3"]
    for w, m in (("w0", "llama"), ("w1", "gpt2"), ("w4", "gpt2")):  # switched generators run published weights
        used = _bits_exact(result, records, w, m)
        assert used and used[0]["weight_version"] > 0, (w, m)
    assert run.leftover() == []


def test_a_silent_peer_is_presumed_gone_and_its_peer_trains_solo(tmp_path, engine_cache):
    # w0 generates gpt2, w1 llama, w2 learns gpt2, w3 llama; at llama's step 2 it loses its only generator.
    # gpt2's steps come a second or so apart, a few seconds with the suite's other workers beside it: 8 s of
    # silence is llama's alone
    run = _pool_run(tmp_path, engine_cache, *static_pool(4, 20, (1, 1, 1, 1)), "timeouts.peer_silent_s=8",
                    "timeouts.peer_wait_s=1", "train.max_model_lead_steps=2",
                    script(("llama", 2, "w1", "idle", "")))
    assert run.finish() == 1, run.out[-3000:]  # llama could not finish: the run says so
    assert "llama made no progress" in (run.run_dir / "FAILED").read_text()
    gone = run.events("peer_gone", "gpt2")
    assert gone and gone[0]["peer"] == "llama" and "no learner step" in gone[0]["reason"]
    solo = [s for s in run.steps("gpt2") if s["solo"]]
    assert solo and all(s["peers_gone"] == ["llama"] and s["peer_wait_s"] < 1.0 for s in solo)
    steps = run.result()["steps"]
    assert steps["gpt2"] == 20 and steps["gpt2"] > steps["llama"] + 2 + 3, steps  # far past the lead limit
    assert run.leftover() == []


def test_sync_mode_generates_step_k_with_the_weights_of_step_k(tmp_path, engine_cache):
    """On the channel. Sync mode is a dispatch rule, and the generator waits for a unit's version through its weight
    reader's load(), whichever the path; that load() over pair groups returns each version bit for bit is
    test_weight_broadcast.py's first test."""
    run = Run(tmp_path / "run", engine_cache, "run.mode=sync", "train.steps=6", "pool.weights=channel")
    assert run.finish() == 0, run.out[-3000:]
    Q = 8
    versions = {(e.model, e.prompt_id // Q, e.weight_version) for e in ExperienceLogReader(run.run_dir / "experience_log")}
    assert {(m, k) for m, k, _ in versions} == {(m, k) for m in ("gpt2", "llama") for k in range(6)}
    assert all(v == k for _, k, v in versions), sorted(versions)
    assert all(s["staleness_mean"] == 0.0 for s in run.steps())


def test_mwra_moves_workers_after_the_costs_swap(tmp_path, engine_cache):
    """The run goes on until MWRA has moved a worker after the costs swap (30 s into the RL phase, on the clock of
    the cost model, which starts with the first allocation, before the learners have loaded), however long this
    machine takes to get there (the wait fails past 5 minutes), then stops with its checkpoints."""
    run = _pool_run(tmp_path, engine_cache, "run.max_minutes=12", "pool.costs.1.from_s=30",
                    "pool.controller={decision_interval_s = 2.0, cooldown_s = 4.0, min_dwell_s = 6.0, "
                    "ewma_halflife_s = 3.0, min_busy_s = 0.5}")

    def late_moves() -> list[dict]:
        records = run.records()
        clock = [r["time"] for r in records if r.get("event") == "allocation"]
        return [r for r in records if clock and r.get("kind") == "mwra_decision" and r["acted"]
                and r["time"] > clock[0] + 30]

    run.wait_for(late_moves, "an MWRA move after the swap of the costs", timeout=300)
    run.signal(signal.SIGTERM)
    assert run.finish() == 143, run.out[-3000:]
    result = run.result()
    assert result["moves"] >= 2 and result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0
    assert all(len(set(f["digests"].values())) == 1 for f in result["formations"])


@pytest.mark.parametrize("sets, words", [
    (["pool.workers=3"], ["--set pool.workers=3", "pool.workers", "at least 4"]),
    (["pool.split={'generator:gpt2' = 9}"], ["pool.split", "must give a count"]),
    (["pool.prompts_per_work=5"], ["pool.prompts_per_work", "train.prompts_per_step"]),
    (["pool.script=[{step_of = 'gpt3', at_step = 1, worker = 'w1', role = 'idle'}]"], ["step_of", "gpt3"]),
])
def test_a_bad_pool_config_is_one_line_and_exit_2(tmp_path, sets, words):
    args = [sys.executable, str(ROOT / "launch.py"), "run", "--config", str(ROOT / POOL), "--run-dir",
            str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert all(w in out.stderr for w in words) and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
