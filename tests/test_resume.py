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
    run.wait_steps(2, "llama", timeout=900)
    run.signal(signal.SIGINT)
    run.wait_for(lambda: "SIGINT during the run: stopping" in run.out, "the first Ctrl-C's line")
    run.signal(signal.SIGINT)
    assert run.finish() == 130, run.out[-3000:]
    assert not (run.run_dir / "FAILED").exists() and "not trained (kept in the log: a resume trains them)" in run.out
    assert "a second SIGINT skipped them; `launch.py resume" in (run.run_dir / "INTERRUPTED").read_text()
    assert not [r for r in run.steps("gpt2") + run.steps("llama") if "checkpoint" in r]
    assert run.leftover() == []
    swapped = {"w0": ["generator", "llama"], "w1": ["generator", "gpt2"], "w2": ["learner", "gpt2"],
               "w3": ["learner", "llama"]}
    assert json.loads((run.run_dir / "allocation.json").read_text())["assignment"] == swapped
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
def test_a_dead_last_learner_restarts_from_its_checkpoint_inside_the_run(tmp_path, engine_cache):
    run = Run(tmp_path / "run", engine_cache, f"train.steps={STEPS}", "run.checkpoint_every=2")
    run.wait_for(lambda: any("checkpoint" in r for r in run.steps("llama")) and len(run.steps("llama")) >= 3,
                 "a checkpoint and 3 steps of llama", timeout=900)
    run.kill_worker("w3")  # llama's only learner rank
    assert run.finish() == 0, run.out[-3000:]
    assert "[run] w3 (learner of llama) exited with code -9: w4 restarts llama's learner from its step-" in run.out
    restart = run.events("learner_restart")
    assert [(r["gen_model"], r["worker"], r["attempt"], r["backoff_s"]) for r in restart] == [("llama", "w4", 1, 1.0)]
    trained = _lineage(run.records(), "llama")
    assert sorted(trained) == list(range(STEPS * Q)), "llama: a prompt skipped or trained twice across the restart"
    result = run.result()
    assert result["steps"] == {"gpt2": STEPS, "llama": STEPS} and result["respawned"] == ["w4"]
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert run.leftover() == []


@pytest.mark.slow
def test_a_killed_broker_is_restarted_and_the_run_loses_and_repeats_nothing(tmp_path, engine_cache):
    run = Run(tmp_path / "run", engine_cache, f"train.steps={STEPS}")
    run.wait_steps(3, "llama", timeout=900)
    run.kill_worker("broker")
    assert run.finish() == 0, run.out[-3000:]
    assert "[run] the broker exited with code -9 while the run was going: restarting it" in run.out
    assert [r["restarts"] for r in run.events("broker_restart")] == [1]
    assert {r["model"] for r in run.events("broker_replay")} == {"gpt2", "llama"}  # each leader re-read the log
    _check_every_prompt_once(run)
    assert run.leftover() == []


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
