"""Sharded learners in a real run (``train.sharding = "fsdp2"``): configs/pool.toml with llama's learner group
on two gloo ranks, re-formed while the run goes by scripted moves (a rank leaves, later joins again).

Every formation starts from rank 0's exact state, generators run exactly the weights the sharded group
published, a periodic checkpoint inside a sharded formation holds whole AdamW moments, and a sharded
follower holds about half of a replicated rank's memory. A rank that dies loses the group's state: the
survivors start again from the newest checkpoint (a replacement joins them), or with none the model leaves
the run, each in one line and a metrics record."""

from __future__ import annotations

import pytest
import torch
from enginerun import Run
from poolsetup import script, static_pool
from test_engine_pool import _bits_exact

pytestmark = pytest.mark.slow
SHARDED = ["train.sharding=fsdp2", "train.grad_accum=2"]


def test_a_sharded_group_trains_reforms_and_hands_over_exactly(tmp_path, engine_cache):
    """On the channel: the sharded leader gathers the whole state and publishes it as a replicated leader does,
    through the same writer (pair groups: test_weight_broadcast.py, and the replicated runs over broadcast)."""
    # pool-key order: w0 generates gpt2, w1 llama, w2 learns gpt2, w3 (leader) + w4 learn llama
    run = Run(tmp_path / "run", engine_cache, *static_pool(5, 12, (1, 1, 1, 2)), *SHARDED, "pool.weights=channel",
              "run.checkpoint_every=3", "run.keep_checkpoints=10",
              # one step ahead at most: llama's steps 5-7 are generated after the move, by w4 (with more, w1
              # may have generated them before it moved, on a loaded machine)
              "train.max_inflight_steps=1",
              # from llama's step 4 to 7 the follower w4 is llama's only generator (w1 helps gpt2 meanwhile)
              script(("llama", 4, "w4", "generator", "llama"), ("llama", 4, "w1", "generator", "gpt2"),
                     ("llama", 7, "w4", "learner", "llama"), ("llama", 7, "w1", "generator", "llama")),
              config="configs/pool.toml")
    assert run.finish() == 0, run.out[-3000:]
    result, records = run.result(), run.records()
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    llama = [f for f in result["formations"] if f["model"] == "llama"]
    assert [sorted(f["digests"]) for f in llama] == [["w3", "w4"], ["w3"], ["w3", "w4"]]
    for f in llama:  # closing a sharded formation gave the leader the whole state the next one starts from
        assert len(set(f["digests"].values())) == 1, f
    steps = [r for r in records if r.get("event") == "step" and r["model"] == "llama"]
    assert {r["world"] for r in steps} == {1, 2} and [r["step"] for r in steps] == list(range(1, 13))
    used = _bits_exact(result, records, "w4", "llama")  # the follower, moved to generate: the published weights
    assert used and used[0]["weight_version"] >= 4, used
    sharded_ckpt = run.run_dir / "checkpoints" / "llama" / "step-000003"  # inside the first sharded formation
    trainer = torch.load(sharded_ckpt / "trainer.pt", weights_only=True)["optimizer"]
    start = next(r for r in records if r.get("event") == "start" and r["model"] == "llama")
    n_params = start["weight_sync_bytes"] // 4
    moments = [s["exp_avg"] for s in trainer["state"].values()]
    assert sum(t.numel() for t in moments) == n_params, "a sharded checkpoint holds whole AdamW moments"
    joined = next(r for r in records if r.get("event") == "role_switch" and r["worker"] == "w4"
                  and r["to_role"] == "learner")
    left = next(r for r in records if r.get("event") == "role_switch" and r["worker"] == "w4"
                and r["from_role"] == "learner")
    # a replicated rank holds weights + two AdamW moments (3x the weights); a sharded follower half of each,
    # and after its formation closed, its module only (the leader alone takes the moments back)
    assert joined["held_bytes_after_acquire"] < 2 * start["weight_sync_bytes"], joined
    assert left["held_bytes_before"] < 1.5 * start["weight_sync_bytes"], left
    assert run.leftover() == []


def _follower_killed(tmp_path, cache, steps: int, checkpoint_every: int, at_step: int) -> Run:
    """A run whose llama follower rank w4 is SIGKILLed once llama's learner reached ``at_step``."""
    run = Run(tmp_path / "run", cache, *static_pool(5, steps, (1, 1, 1, 2)), *SHARDED,
              f"run.checkpoint_every={checkpoint_every}", config="configs/pool.toml")
    run.wait_steps(at_step, "llama")
    run.kill_worker("w4")
    return run


def test_a_dead_sharded_rank_restarts_its_group_from_the_checkpoint(tmp_path, engine_cache):
    run = _follower_killed(tmp_path, engine_cache, steps=14, checkpoint_every=3, at_step=5)
    assert run.finish() == 0, run.out[-3000:]
    result, records = run.result(), run.records()
    restart = run.events("learner_restart")
    assert len(restart) == 1 and restart[0]["gen_model"] == "llama" and restart[0]["sharded"], restart
    assert "sharded group (w3) restarts from its step-" in run.out and "w5 takes the dead rank's place" in run.out
    back_to, at = restart[0]["step"], restart[0]["time"]
    steps = [r for r in records if r.get("event") == "step" and r["model"] == "llama"]
    before, after = [r["step"] for r in steps if r["time"] <= at], [r["step"] for r in steps if r["time"] > at]
    assert before == list(range(1, len(before) + 1)) and len(before) >= 5 and back_to == 3, (before, back_to)
    assert after == list(range(back_to + 1, 15)), after  # the steps after the checkpoint are trained again
    llama = [f for f in result["formations"] if f["model"] == "llama"]
    assert sorted(llama[-1]["digests"]) == ["w3", "w5"] and len(set(llama[-1]["digests"].values())) == 1
    assert result["steps"]["llama"] == 14
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert run.leftover() == []


def test_a_sharded_group_without_a_checkpoint_takes_its_model_out(tmp_path, engine_cache):
    run = _follower_killed(tmp_path, engine_cache, steps=10, checkpoint_every=0, at_step=2)
    assert run.finish() != 0, run.out[-3000:]
    left = run.events("model_left")
    assert [r["gen_model"] for r in left] == ["llama"] and "no checkpoint" in left[0]["reason"], left
    assert "llama leaves the run" in run.out and "run.checkpoint_every" in run.out
    assert (run.run_dir / "FAILED").exists() and run.result()["audit"]["lost"] == 0
    assert run.leftover() == []
