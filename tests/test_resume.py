"""Stop or kill a run, `launch.py resume` it: it ends where an uninterrupted run ends, nothing lost or trained twice.

The proof is the prompt ids each learner trained on (every step record lists them): walking the
records in order, each resume goes back to the step of the checkpoint it started from, and the
surviving lineage must hold every prompt of the run exactly once. The experience log audit
(``run_result.json``) must say 0 lost and 0 duplicated.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine.config import load_run_config
from engine.schedule.dispatch import Dispatch
from tasks.registry import make_task
from tests.enginerun import ROOT, Run
from tests.poolsetup import script

STEPS, Q = 8, 8  # smoke.toml: 8 prompts a step


def _lineage(records: list[dict], model: str, steps: int = STEPS) -> list[int]:
    """Prompts trained by ``model``'s surviving lineage, in step order: each resume (of the launcher, or of
    a learner restarted inside the run) goes back to its checkpoint's step, and what came after it is gone."""
    trained: dict[int, list[int]] = {}
    for r in records:
        if r.get("event") == "resume" and model in (r.get("model"), r.get("gen_model")):
            trained = {step: prompts for step, prompts in trained.items() if step <= r["step"]}
        elif r.get("event") == "step" and r["model"] == model:
            assert r["step"] not in trained, f"{model}: step {r['step']} taken twice in one lineage"
            trained[r["step"]] = r["prompts"]
    assert sorted(trained) == list(range(1, steps + 1)), (model, sorted(trained))
    return [p for step in sorted(trained) for p in trained[step]]


def _check_every_prompt_once(run: Run, steps: int = STEPS) -> None:
    """Every step was taken, the audit is clean, and each model's lineage trained every prompt exactly once."""
    result = run.result()
    assert result["steps"] == {"gpt2": steps, "llama": steps}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    records = run.records()
    for model in ("gpt2", "llama"):
        trained = _lineage(records, model, steps)
        print(f"{model}: {len(trained)} prompts trained, {len(set(trained))} distinct; audit {result['audit']}")
        assert sorted(trained) == list(range(steps * Q)), f"{model}: a prompt skipped or trained twice"


def _check_resumed(run: Run, steps: int = STEPS) -> None:
    assert run.finish() == 0, run.out[-3000:]
    _check_every_prompt_once(run, steps)
    assert not (run.run_dir / "FAILED").exists() and not (run.run_dir / "INTERRUPTED").exists()
    assert run.leftover() == []
    report = (run.run_dir / "report.md").read_text()  # every run ends with its report, covering both sessions
    assert f"| {run.run_dir.name} | gpt2 |" in report and "resume (engine)" in report
    assert all((run.run_dir / name).is_file() for name in ("accuracy.png", "reward.png", "throughput.png"))


def _session(records: list[dict], n: int) -> list[dict]:
    """The records of the n-th session of a run (0: the first; each ``launch.py resume`` starts one)."""
    cuts = [0] + [i for i, r in enumerate(records) if r.get("event") == "resumed"] + [len(records)]
    return records[cuts[n]:cuts[n + 1]] if n + 1 < len(cuts) else []


def _assignment(run_dir: Path) -> dict | None:
    """allocation.json's split (replaced whole when it changes), None before the first."""
    path = run_dir / "allocation.json"
    return json.loads(path.read_text())["assignment"] if path.is_file() else None


def _check_split_kept(session: list[dict], split: dict[str, list[str]]) -> None:
    """A resumed session starts from ``split`` (allocation.json) and makes no scripted move again."""
    assert [r["restored"] for r in session if r.get("event") == "resume_allocation"] == [True]
    assert [r["workers"] for r in session if r.get("event") == "allocation"][0] == split
    assert not [r for r in session if r.get("event") == "assign" and "scripted" in r["reason"]]


@pytest.mark.slow
def test_a_run_stopped_twice_and_killed_resumes_each_time_where_it_stopped_and_trains_longer(tmp_path, engine_cache):
    """One run, five sessions (each kind of stop once; one run, not one each, for the suite's time):
    1. a double Ctrl-C at llama's step 2, before any checkpoint (run.checkpoint_every = 6): final checkpoints
       skipped, INTERRUPTED, exit 130, resumable;
    2. resumed: from the warm start, the logged samples trained; SIGTERM: it stops with checkpoints, exit 143;
    3. resumed: each model from the step it stopped at; SIGKILL of the launcher alone after a new checkpoint (its
       workers must notice and leave on their own, and remove its socket folder);
    4. resumed: the run ends where an uninterrupted one ends, every prompt trained once by each lineage;
    5. the finished run resumed with more steps trains only the new prompts.
    The two generators swap models at gpt2's step 1 (scripted): every resumed session starts from the swapped
    split, and the script does not fire again."""
    steps = 18  # room for a periodic checkpoint (step 6 or 12) after the SIGTERM and before the end
    swap = script(("gpt2", 1, "w0", "generator", "llama"), ("gpt2", 1, "w1", "generator", "gpt2"))
    run = Run(tmp_path / "run", engine_cache, f"train.steps={steps}", "run.checkpoint_every=6", swap)
    swapped = {"w0": ["generator", "llama"], "w1": ["generator", "gpt2"], "w2": ["learner", "gpt2"],
               "w3": ["learner", "llama"]}
    run.wait_steps(2, "llama", timeout=900)
    # llama may reach step 2 before gpt2's step 1 has fired the swap, or while it is under way: wait for it
    run.wait_for(lambda: _assignment(run.run_dir) == swapped, "the scripted swap in allocation.json")
    run.signal(signal.SIGINT)
    run.wait_for(lambda: "SIGINT during the run: stopping" in run.out, "the first Ctrl-C's line")
    run.signal(signal.SIGINT)
    assert run.finish() == 130, run.out[-3000:]
    assert not (run.run_dir / "FAILED").exists() and "not trained (kept in the log: a resume trains them)" in run.out
    assert "a second SIGINT skipped them; `launch.py resume" in (run.run_dir / "INTERRUPTED").read_text()
    assert not [r for r in run.steps("gpt2") + run.steps("llama") if "checkpoint" in r]
    assert run.leftover() == []
    assert _assignment(run.run_dir) == swapped
    assert len([r for r in run.events("assign") if "scripted" in r["reason"]]) == 2

    second = Run(run.run_dir, None)
    second.wait_for(lambda: any(r.get("event") == "step" and r["step"] >= 2 for r in _session(second.records(), 1)),
                    "2 resumed steps")
    assert "[resume] gpt2: from the warm start (no checkpoint yet)" in second.out
    _check_split_kept(_session(second.records(), 1), swapped)
    second.signal(signal.SIGTERM)
    assert second.finish() == 143, second.out[-3000:]
    stopped = {r["model"]: r["step"] for r in _session(second.records(), 1) if r.get("event") == "final"}
    assert set(stopped) == {"gpt2", "llama"}

    third = Run(run.run_dir, None)
    third.wait_for(lambda: all(
        any("checkpoint" in r and r["step"] > stopped[m] for r in _session(third.records(), 2)
            if r.get("event") == "step" and r["model"] == m) for m in ("gpt2", "llama")),
        "a checkpoint of each model after the resume", timeout=900)
    resumes = [r for r in _session(third.records(), 2) if r.get("event") == "resume" and "gen_model" in r]
    assert {r["gen_model"]: r["step"] for r in resumes} == stopped  # each model went on from where it stopped
    assert any(r.get("event") == "resumed" and "SIGTERM" in json.dumps(r) for r in third.records())
    _check_split_kept(_session(third.records(), 2), swapped)
    third.track()
    # The coordinator's weight channels and its ipc sockets' folder, read while it lives: once it is killed, any run
    # that starts on the host (a parallel worker's of the suite too) may remove the channels first
    # (tests/test_engine_weights.py checks that sweep); only its launcher removes the sockets in a run that ends.
    owned = [d for pattern in (f"/dev/shm/mutual-rl-{run.run_dir.name}-*", f"{tempfile.gettempdir()}/mrl-*")
             for d in glob.glob(pattern)
             if Path(d, "owner.pid").is_file() and Path(d, "owner.pid").read_text() == str(third.proc.pid)]
    orphans = [d for d in owned if d.startswith("/dev/shm/")]
    sockets = [d for d in owned if not d.startswith("/dev/shm/")]
    assert orphans and len(sockets) == 1
    os.kill(third.proc.pid, signal.SIGKILL)
    third.finish()
    assert third.leftover() == [], "a killed launcher left processes behind"
    assert not os.path.exists(sockets[0]), "a killed launcher's socket folder was left behind"

    fourth = Run(run.run_dir, None, report=True)
    _check_resumed(fourth, steps)
    assert "[resume] gpt2: from step" in fourth.out and "logged samples to replay" in fourth.out
    assert "[resume] workers take the roles they had when the run stopped: w0 generator:llama" in fourth.out
    _check_split_kept(_session(fourth.records(), 3), swapped)
    assert not [p for p in orphans if os.path.exists(p)], "the next run did not remove a dead run's shared memory"

    records = fourth.records()
    longer = Run(run.run_dir, None, f"train.steps={steps + 2}")  # a finished run, resumed to train longer
    assert longer.finish() == 0, longer.out[-3000:]
    assert longer.result()["steps"] == {"gpt2": steps + 2, "llama": steps + 2}
    assert longer.result()["audit"]["lost"] == 0 and longer.result()["audit"]["duplicates"] == 0
    extra = [r for r in longer.records()[len(records):] if r.get("event") == "step" and r["model"] == "gpt2"]
    assert sorted(p for r in extra for p in r["prompts"]) == list(range(steps * Q, (steps + 2) * Q))


@pytest.mark.slow
def test_a_dead_generator_a_killed_broker_and_a_dead_last_learner_are_replaced_and_nothing_is_lost(tmp_path,
                                                                                                   engine_cache):
    """Three deaths in one run (one run for the three, for the suite's time), each recovered inside the run:
    - gpt2's generator (w0) SIGKILLed at gpt2's step 2: w4 takes its place;
    - the broker SIGKILLed once w4 has: it is restarted, and each leader re-reads the log;
    - llama's only learner rank (w3) SIGKILLed at a checkpoint after that: w5 restarts llama's learner from it.
    The run ends with every step; each model's lineage trained every prompt once; the audit: 0 lost, 0 duplicated.
    It carries ``objective.kl_coef=0.05`` too: both models train with obj/kl > 0 in metrics.jsonl and TensorBoard,
    llama's from its starting weights across its restart (tests/test_kl_reference.py: the term itself)."""
    steps = 30  # room for the three deaths and their recoveries before the end, on a fast machine too
    run = Run(tmp_path / "run", engine_cache, f"train.steps={steps}", "run.checkpoint_every=2",
              "objective.kl_coef=0.05")
    run.wait_steps(2, "gpt2")
    run.kill_worker("w0")  # the static split, in pool-key order: w0 generates for gpt2
    run.wait_for(lambda: "w4 takes its place" in run.out, "w4 in w0's place")
    run.kill_worker("broker")
    run.wait_for(lambda: {r["model"] for r in run.events("broker_replay")} == {"gpt2", "llama"}, "the logs re-read")
    restarted_at = len(run.steps("llama"))
    run.wait_for(lambda: any("checkpoint" in r for r in run.steps("llama")[restarted_at:]), "a checkpoint of llama")
    run.kill_worker("w3")  # llama's only learner rank
    assert run.finish() == 0, run.out[-3000:]

    assert "[run] w0 (generator of gpt2) exited with code -9" in run.out and "w4 takes its place" in run.out
    assert "[run] the broker exited with code -9 while the run was going: restarting it" in run.out
    assert [r["restarts"] for r in run.events("broker_restart")] == [1]
    assert "[run] w3 (learner of llama) exited with code -9: w5 restarts llama's learner from its step-" in run.out
    restart = run.events("learner_restart")
    assert [(r["gen_model"], r["worker"], r["attempt"], r["backoff_s"]) for r in restart] == [("llama", "w5", 1, 1.0)]
    lost = run.events("worker_lost")
    assert [(r["worker"], r["role"]) for r in lost] == [("w0", "generator"), ("w3", "learner")]
    result = run.result()
    assert result["lost_workers"] == ["w0", "w3"] and result["respawned"] == ["w4", "w5"]
    _check_every_prompt_once(run, steps)
    assert run.leftover() == []

    kls = {model: [s["obj/kl"] for s in run.steps(model)] for model in ("gpt2", "llama")}
    assert len(kls["gpt2"]) == steps and kls["gpt2"][0] == 0.0 and kls["gpt2"][-1] > 0.0, kls["gpt2"]
    assert all(k >= 0.0 for k in kls["gpt2"] + kls["llama"]), kls
    resumed = [r for r in run.records() if r.get("event") == "resume" and "llama" in (r.get("model"), r.get("gen_model"))]
    after = [s for s in run.steps("llama") if s["step"] > resumed[-1]["step"]]
    assert resumed and after and after[0]["obj/kl"] > 0.0, (resumed, after[:2])  # the start's, not the checkpoint's
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(run.run_dir / "tensorboard" / "gpt2"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("obj/kl")] == pytest.approx(kls["gpt2"], abs=1e-6)


def test_resume_refuses_what_it_cannot_resume(tmp_path):
    (tmp_path / "empty").mkdir()
    for target, words in ((tmp_path / "empty", "not a run directory"), (tmp_path / "missing", "not a run directory")):
        out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "resume", str(target)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_dispatcher_hands_out_again_only_what_was_neither_trained_nor_logged_whole():
    cfg = load_run_config(str(ROOT / "configs/smoke.toml"), [])
    dispatch = Dispatch(cfg, make_task(cfg.task))
    consumed = set(range(8))  # step 0 trained
    logged = {p: 8 for p in range(8, 16)} | {16: 3}  # step 1 whole in the log, one prompt of step 2 partly
    owed = dispatch.resume("gpt2", 1, consumed, logged)
    assert owed == list(range(16, 24))  # the partial prompt and the rest of step 2, never step 0 or 1
    assert dispatch.issued["gpt2"] == 3 and dispatch.steps["gpt2"] == 1
    units = list(dispatch.ready["gpt2"])
    assert sorted(p for u in units for p in u.prompt_ids) == owed and all(u.step == 2 for u in units)
