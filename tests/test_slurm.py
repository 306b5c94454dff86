"""``launch.py slurm``: the sbatch script (one launcher per node by srun, in torchrun's environment), its one-line
refusals, and a real one-node Slurm started here (tests/slurmlocal.py): a submitted run trains to the end, and a
job cancelled mid-run (Slurm's SIGTERM) stops cleanly and resumes through ``--resume`` with nothing lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmlocal import job_state, local_slurm, wait_job, why_not

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


def _launch(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "slurm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_script_starts_one_launcher_a_node_in_torchruns_environment(tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, str(ROOT / "launch.py"), "keys", str(keys), "--name", "cluster"], check=True,
                   capture_output=True)
    done = _launch("--config", str(SMOKE), "--nodes", "2", "--keys", str(keys), "--run-dir", "runs/a",
                   "--partition", "gpu", "--time", "02:00:00", "--gpus-per-node", "4", "--sbatch=--account=rl",
                   "--set", 'run.name="my run"', "--set", "train.steps=20", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for line in ("#SBATCH --job-name=mrl-my-run", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=3", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --time=02:00:00", "#SBATCH --account=rl",
                 f"#SBATCH --output={tmp_path}/runs/a.slurm-%j.out", f"export MUTUAL_RL_CLUSTER_KEYS={keys}",
                 'export WORLD_SIZE="$SLURM_NNODES" LOCAL_WORLD_SIZE=1'):
        assert line in script.splitlines(), line
    srun = script.splitlines()[-1]
    assert srun.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'export RANK=\"$SLURM_NODEID\"")
    assert f"launch.py run --config {SMOKE} --run-dir {tmp_path}/runs/a --set " in srun
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args, said", [
    (["--nodes", "2"], "error: --nodes > 1: the engine's sockets between nodes need --keys DIR"),
    (["--nodes", "0"], "error: --nodes 0: at least 1"),
    (["--nodes", "5", "--insecure"], "error: --nodes 5: pool.workers = 4 leaves a node without a worker"),
    (["--set", "train.stpes=3"], "error: --set train.stpes=3: train: unknown field stpes (did you mean steps?)"),
    (["--resume", "nowhere"], "error: --resume nowhere: not a run directory (no config.toml)"),
])
def test_a_request_that_cannot_run_is_one_line(tmp_path, args, said):
    done = _launch("--config", str(SMOKE), *args, "--dry-run", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.strip() == done.stderr.strip().splitlines()[0]
    assert done.stderr.startswith(said), done.stderr


def test_without_sbatch_it_says_so(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "slurm", "--config", str(SMOKE)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PATH": "/nonexistent"})
    assert done.returncode == 2 and done.stderr.startswith("error: sbatch is not on PATH"), done.stderr


def _submitted(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"submitted Slurm job (\d+)", done.stdout).group(1)


@pytest.mark.slow
@pytest.mark.skipif(why_not() is not None, reason=f"no local Slurm: {why_not()}")
def test_slurm_runs_a_job_to_the_end_and_resumes_a_cancelled_one(tmp_path, engine_cache):
    with local_slurm(tmp_path / "slurm") as env:
        cache = ["--set", f'run.cache_dir="{engine_cache}"', "--set", "run.report=false"]
        job = _submitted(_launch("--config", str(SMOKE), "--run-dir", "runs/whole", *cache, cwd=tmp_path, env=env))
        assert wait_job(env, job, 600) == "COMPLETED", _tail(tmp_path / f"runs/whole.slurm-{job}.out")
        out = (tmp_path / f"runs/whole.slurm-{job}.out").read_text()
        result = json.loads((tmp_path / "runs/whole/run_result.json").read_text())
        assert result["steps"] == {"gpt2": 12, "llama": 12}, out[-3000:]
        assert re.search(r"experience logged \d+, lost 0, duplicated 0", out), out[-3000:]

        # a job cancelled mid-run: Slurm's SIGTERM stops the run as Ctrl-C does; --resume submits the rest
        long = ["--set", "train.steps=400", "--set", "run.checkpoint_every=0"]
        job = _submitted(_launch("--config", str(SMOKE), "--run-dir", "runs/cut", *cache, *long, cwd=tmp_path,
                                 env=env))
        metrics = tmp_path / "runs/cut/metrics.jsonl"
        deadline = time.time() + 600
        while not (metrics.exists() and sum('"event": "step"' in line for line in metrics.read_text().splitlines()) >= 4):
            assert job_state(env, job) in ("PENDING", "RUNNING"), _tail(tmp_path / f"runs/cut.slurm-{job}.out")
            assert time.time() < deadline, "no 4 steps within 600 s"
            time.sleep(0.2)
        subprocess.run(["scancel", job], env=env, check=True)
        wait_job(env, job, 300)
        assert "stopped by SIGTERM" in (tmp_path / "runs/cut/INTERRUPTED").read_text()
        job = _submitted(_launch("--resume", "runs/cut", "--set", "train.steps=16", cwd=tmp_path, env=env))
        assert wait_job(env, job, 600) == "COMPLETED", _tail(tmp_path / f"runs/cut.slurm-{job}.out")
        out = (tmp_path / f"runs/cut.slurm-{job}.out").read_text()
        assert json.loads((tmp_path / "runs/cut/run_result.json").read_text())["steps"] == {"gpt2": 16, "llama": 16}
        assert "resuming" in out and re.search(r"experience logged \d+, lost 0, duplicated 0", out), out[-3000:]


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"{path}: no output"
