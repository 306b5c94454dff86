"""`launch.py pool` as a user runs it: bad input is one line and exit 2; a short run ends with
the held-out summary of the final checkpoints and the no-loss audit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from poolsetup import static_pool

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "pool", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_bad_pool_config_is_one_line_and_exit_2(tmp_path):
    out = launch("--set", "pool.workers=3", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pool.workers" in lines[0] and "Traceback" not in out.stderr
    out = launch("--set", "pool.static_split={'generator:gpt2' = 9}", "--set", "pool.mode=static",
                 "--run-dir", str(tmp_path / "run2"))
    assert out.returncode == 2 and "pool.static_split" in out.stderr and "Traceback" not in out.stderr
    out = launch("--set", "pool.prompts_per_work=5", "--run-dir", str(tmp_path / "run3"))  # Q is 4
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pool.prompts_per_work" in out.stderr and "train.prompts_per_step" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_pool_run_reports_held_out_accuracy(tmp_path):
    run_dir = tmp_path / "run"
    out = launch("--set", "pool.workers=4", "--set", "pool.duration_s=15", "--set", "eval.num_problems=50",
                 "--run-dir", str(run_dir))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "mutual RL summary" in out.stdout and "held-out evaluation of the final checkpoints" in out.stdout
    assert "experience lost 0, duplicated 0" in out.stdout
    for model in ("gpt2", "llama"):
        assert (run_dir / "checkpoints" / model / "config.json").exists()
    assert (run_dir / "pool_result.json").exists() and (run_dir / "metrics.jsonl").exists()


def kill_after_first_step(run_dir: Path, worker: str, *sets: str) -> tuple[subprocess.CompletedProcess, set, float]:
    """Start `launch.py pool`, SIGKILL ``worker`` once a learner has stepped; (result, child pids, kill time)."""
    run = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "pool", *sets, "--run-dir", str(run_dir)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and '"event": "step"' not in (metrics.read_text() if metrics.exists() else ""):
        time.sleep(0.5)
    children = {c.pid for c in psutil.Process(run.pid).children(recursive=True)}
    killed_at = time.time()
    os.kill(json.loads((run_dir / "pids.json").read_text())[worker], signal.SIGKILL)
    out, err = run.communicate(timeout=300)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err), children, killed_at


def no_process_left(children: set) -> bool:
    time.sleep(1.0)
    return not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_worker_that_cannot_be_spared_fails_the_run_with_one_clear_error(tmp_path):
    # four workers, one per pool: losing the gpt2 generator leaves too few to go on
    run_dir = tmp_path / "run"
    out, children, _ = kill_after_first_step(run_dir, "w0", "--set", "pool.workers=4", "--set", "pool.duration_s=120")
    assert out.returncode == 1, (out.stdout + out.stderr)[-3000:]
    assert "error: w0 exited with code -9 while the run was going" in out.stderr and "Traceback" not in out.stderr
    assert (run_dir / "FAILED").exists()
    assert no_process_left(children)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_generator_is_written_off_and_its_units_regenerated(tmp_path):
    run_dir = tmp_path / "run"
    sets = [arg for o in static_pool(6, 25, (2, 2, 1, 1), gen_s=0.1) + ["eval.num_problems=50"] for arg in ("--set", o)]
    out, children, killed_at = kill_after_first_step(run_dir, "w0", *sets)
    # static split in pool-key order: w0 and w1 generate gpt2
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "[pool] w0 (generator of gpt2) exited with code -9" in out.stderr and "goes on with 5 workers" in out.stderr
    assert "Traceback" not in out.stderr and "generators that died and were written off: w0" in out.stdout
    result = json.loads((run_dir / "pool_result.json").read_text())
    assert result["lost_workers"] == ["w0"]
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in records if r.get("event") == "worker_lost"]
    assert [(r["worker"], r["gen_model"]) for r in lost] == [("w0", "gpt2")]
    later = [r for r in records if r.get("event") == "step" and r["model"] == "gpt2" and r["time"] > killed_at + 5]
    assert len(later) >= 3  # gpt2 kept learning on its one remaining generator
    assert no_process_left(children)
