"""benchmarks.gpu: a visible skip without CUDA, and every measurement's code path on a tiny model on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stdout.strip().splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the skip path cannot be seen here")
def test_without_cuda_it_says_so_and_its_json_is_a_skip_not_a_pass() -> None:
    code, lines = _run()
    assert code == 0 and len(lines) == 2
    assert "CUDA is absent" in lines[0]
    result = json.loads(lines[-1])
    assert "CUDA is absent" in result["skipped"] and "ok" not in result


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_tiny_cpu_run_measures_everything_and_ends_with_one_json_object() -> None:
    code, lines = _run("--tiny", "--device", "cpu", "--no-subruns")
    result = json.loads(lines[-1])
    assert code == (0 if result["ok"] else 1)
    assert result["gen_tokens"] == 4 * 8  # a random model over 151k tokens: no row meets EOS in 8 steps
    for key in ("gen_tokens_per_s", "bare_tokens_per_s", "gen_ratio", "learner_tokens_per_s", "sync_s",
                "sync_gb_per_s", "copy_gb_per_s", "sync_ratio"):
        assert result[key] > 0, key
    assert result["sync_bytes"] == 4 * result["params"]  # float32 on the CPU: every weight once, tied head once
    assert result["release_bytes_after_resume"] == result["release_bytes_before"] > 0
    assert "sharded_error" not in result, result.get("sharded_error")  # FSDP2 at world 1 (gloo here, NCCL on a GPU)
    assert result["sharded_version"] == 3 and result["sharded_tokens_per_s"] > 0  # warm-up + train_steps (2)
