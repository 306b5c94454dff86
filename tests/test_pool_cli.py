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
