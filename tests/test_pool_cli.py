"""`launch.py pool` as a user runs it: bad input is one line and exit 2; a short run ends with
the held-out summary of the final checkpoints and the no-loss audit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_worker_fails_the_pool_run_with_one_clear_error(tmp_path):
    import json
    import os
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "pool", "--set", "pool.workers=4",
                             "--set", "pool.duration_s=120", "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and '"event": "step"' not in (metrics.read_text() if metrics.exists() else ""):
        time.sleep(0.5)
    children = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    os.kill(json.loads((run_dir / "pids.json").read_text())["w0"], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out + err)[-3000:]
    assert "error: w0 exited with code -9 while the run was going" in err and "Traceback" not in err
    assert (run_dir / "FAILED").exists()
    time.sleep(1.0)
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
