"""The whole engine, for real: `launch.py run` on the smoke config, as a user runs it.

Real processes (broker, learners, generators), real sockets, real tokenizers, real
tiny models. The warm starts are cached in a session directory, so only the first
test pays for them.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutual_rl_cache")


class Run:
    """A launch.py process whose whole process tree is tracked while it lives."""

    def __init__(self, run_dir: Path, cache: Path, *overrides: str):
        self.run_dir = run_dir
        args = [sys.executable, str(ROOT / "launch.py"), "run", "--config", str(SMOKE), "--run-dir", str(run_dir)]
        for o in (f"run.cache_dir='{cache}'", *overrides):
            args += ["--set", o]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.seen: set[int] = set()

    def track(self) -> None:
        try:
            self.seen.update(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, predicate, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            self.track()
            if predicate():
                return True
            time.sleep(0.5)
        return predicate()

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        self.wait_for(lambda: False, timeout)
        if self.proc.poll() is None:
            self.proc.kill()
        out = self.proc.communicate()[0]
        return self.proc.returncode, out

    def leftover(self) -> list[int]:
        time.sleep(1.0)
        return [pid for pid in self.seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self, model: str | None = None) -> list[dict]:
        return [r for r in self.records() if r.get("event") == "step" and (model is None or r["model"] == model)]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, cache_dir) -> tuple[Run, int, str]:
    run = Run(tmp_path_factory.mktemp("smoke") / "run", cache_dir)
    code, out = run.finish()
    return run, code, out


def test_smoke_run_completes_and_writes_its_run_dir(smoke_run):
    run, code, out = smoke_run
    assert code == 0, out[-3000:]
    assert "mutual RL summary" in out
    assert (run.run_dir / "config.toml").exists()
    finals = {r["model"]: r for r in run.records() if r.get("event") == "final"}
    assert set(finals) == {"gpt2", "llama"}
    for name, final in finals.items():
        assert final["step"] == 12 and not final["stopped_early"]
        assert 0.0 <= final["accuracy"] <= 1.0 and final["eval_n"] == 200
        assert (Path(final["checkpoint"]) / "model.safetensors").exists()
    assert run.leftover() == []  # no orphan processes


def test_peer_experience_flows_through_the_thl(smoke_run):
    run, code, _ = smoke_run
    assert code == 0
    required = {"time", "model", "step", "weight_version", "reward_mean", "own_experiences", "peer_experiences",
                "staleness_mean", "thl_residual_mean", "obj/rescue_set_size"}
    for model in ("gpt2", "llama"):
        steps = run.steps(model)
        assert len(steps) == 12
        assert required <= set(steps[-1])
        assert steps[-1]["peer_experiences"] > 0
        residuals = [s["thl_residual_mean"] for s in steps if s["thl_residual_mean"] is not None]
        assert residuals and all(0.0 <= r <= 1.0 for r in residuals)
        versions = [s["weight_version"] for s in steps]
        assert versions == sorted(versions) and versions[-1] == 12


def test_experience_log_holds_every_experience_exactly_once(smoke_run):
    from exchange.log import ExperienceLogReader

    run, code, _ = smoke_run
    assert code == 0
    ids = collections.Counter(e.experience_id for e in ExperienceLogReader(run.run_dir / "experience_log"))
    assert ids and max(ids.values()) == 1
    per_model = collections.Counter(i.split("/")[0] for i in ids)
    assert per_model["gpt2"] >= 12 * 64 and per_model["llama"] >= 12 * 64


def _mean_logprob(checkpoint: str, experiences) -> float:
    from engine.batching import completion_logprobs, pack
    from policies.models import load_policy

    model = load_policy(checkpoint).eval()
    pad = int(model.config.pad_token_id or 0)
    packed = pack([e.prompt_array for e in experiences], [e.completion_array for e in experiences], pad)
    with torch.no_grad():
        logp = completion_logprobs(model, packed)
    return float((logp.sum(1) / packed.comp_mask.sum(1)).mean())


def test_learning_moves_in_the_rewards_direction(smoke_run):
    """Verified-correct samples the learner trained on became more likely than under the warm start."""
    from exchange.log import ExperienceLogReader

    run, code, _ = smoke_run
    assert code == 0
    finals = {r["model"]: r for r in run.records() if r.get("event") == "final"}
    log = list(ExperienceLogReader(run.run_dir / "experience_log"))
    for model, final in finals.items():
        correct = [e for e in log if e.model == model and e.verified]
        assert len(correct) >= 5, f"{model}: too few verified samples to judge"
        after = _mean_logprob(final["checkpoint"], correct)
        before = _mean_logprob(final["warm_checkpoint"], correct)
        assert after > before, f"{model}: mean log-prob of correct samples {before:.3f} -> {after:.3f}"


def test_sigterm_stops_cleanly_with_checkpoints(tmp_path, cache_dir):
    run = Run(tmp_path / "run", cache_dir, "train.steps=1000", "run.max_minutes=5")
    assert run.wait_for(lambda: len(run.steps()) >= 2, timeout=300), "no training steps appeared"
    run.track()
    os.kill(run.proc.pid, signal.SIGTERM)
    code, out = run.finish(timeout=300)
    assert code == 0, out[-3000:]
    finals = [r for r in run.records() if r.get("event") == "final"]
    assert len(finals) == 2 and all(f["stopped_early"] for f in finals)
    assert run.leftover() == []


def test_a_model_whose_process_dies_leaves_its_peer_training_solo(tmp_path, cache_dir):
    run = Run(tmp_path / "run", cache_dir, "train.steps=20", "run.max_minutes=5")
    assert run.wait_for(lambda: len(run.steps("llama")) >= 2, timeout=300), "no training steps appeared"
    run.track()
    pids = json.loads((run.run_dir / "pids.json").read_text())
    os.kill(pids["llama.g0"], signal.SIGKILL)
    code, out = run.finish(timeout=300)
    assert code == 1, out[-3000:]  # a model failed: the run says so in its exit code ...
    assert "llama.g0 exited with code -9" in out and "gpt2 trains without it" in out
    assert "llama failed" in (run.run_dir / "FAILED").read_text()
    finals = {r["model"]: r for r in run.records() if r.get("event") == "final"}
    assert finals["gpt2"]["step"] == 20 and not finals["gpt2"]["stopped_early"]  # ... but its peer went on
    assert "llama" in finals, out[-3000:]  # the failed model's learner checkpointed and evaluated ...
    assert finals["llama"]["stopped_early"] and finals["llama"]["step"] < 20  # ... what it had
    gone = [r for r in run.records() if r.get("event") == "peer_gone" and r["model"] == "gpt2"]
    assert len(gone) == 1 and gone[0]["peer"] == "llama" and "llama.g0" in gone[0]["reason"]
    assert "[gpt2] peer llama sends no more experience" in out
    after = [s for s in run.steps("gpt2") if s["step"] > gone[0]["step"]]
    assert after and all(s["solo"] and s["peers_gone"] == ["llama"] for s in after)
    assert all(s["peer_wait_s"] < 1.0 for s in after)  # no deadline waits for a peer that is gone
    assert run.leftover() == []


def test_death_of_the_broker_stops_the_run_with_an_error(tmp_path, cache_dir):
    run = Run(tmp_path / "run", cache_dir, "train.steps=1000", "run.max_minutes=5")
    assert run.wait_for(lambda: len(run.steps()) >= 2, timeout=300), "no training steps appeared"
    run.track()
    pids = json.loads((run.run_dir / "pids.json").read_text())
    os.kill(pids["broker"], signal.SIGKILL)
    code, out = run.finish(timeout=300)
    assert code == 1, out[-3000:]
    assert "broker exited with code -9" in out
    assert (run.run_dir / "FAILED").exists()
    assert run.leftover() == []
