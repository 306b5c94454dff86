"""Asynchronous vs synchronous RL: the same steps of the smoke workload, both ways, one engine.

Synchronous (``run.mode=sync``, a dispatch rule): step k's prompts are generated only with
the weights of learner step k, so generation and training alternate. Asynchronous (the
default): generators run up to ``train.max_inflight_steps`` ahead, overlapping generation
with training. Each is a real ``launch.py run``; the time compared is the RL phase only:
from the learners' start records to their last step (warm start, process start-up and
final evaluation excluded, as they are equal).

The synchronous baseline runs at its best thread setting: with one model only one of its
two workers is busy at a time, so it is measured with 1 and with 2 torch threads per
worker (``pool.threads_per_worker``) and the faster counts. The asynchronous run keeps 1
thread per worker (two busy processes on two cores). The workload's own limit is
(generation time + training time) / max(generation time, training time), from the
synchronous run's busy times (``run_result.json``): perfect overlap reaches it.

    python -m benchmarks.async_speedup [--steps 20] [--quick] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w
from exchange.records import read_records

ROOT = Path(__file__).resolve().parents[1]


TARGET = 1.5


def rl_phase_seconds(run_dir: Path) -> float:
    records = read_records(run_dir).records
    start = min(r["time"] for r in records if r.get("event") == "start")
    end = max(r["time"] for r in records if r.get("event") == "step")
    return end - start


def workload(models: int, task: str, workdir: Path) -> Path:
    """The smoke config, keeping its first ``models`` models (one model trains solo with GRPO)."""
    tree = tomllib.loads((ROOT / "configs" / "smoke.toml").read_text())
    tree["models"] = tree["models"][:models]
    tree["pool"] = {"workers": 2 * models}  # a generator and a learner per model
    if task != tree["task"]["kind"]:
        tree["task"] = {"kind": task}  # that task's defaults
    if models == 1:
        tree["objective"] = {"kind": "grpo"}
    path = workdir / f"workload-{models}-{task}.toml"
    path.write_text(tomli_w.dumps(tree))
    return path


def run_once(mode: str, steps: int, config: Path, extra: list[str], threads: int) -> tuple[float, dict]:
    """(RL phase seconds, run_result.json) of one run."""
    run_dir = config.parent / f"{config.stem}-{mode}-{threads}t"
    args = [sys.executable, str(ROOT / "launch.py"), "run", "--config", str(config),
            "--run-dir", str(run_dir), "--set", f"run.mode={mode}", "--set", f"train.steps={steps}",
            "--set", "eval.every_steps=0", "--set", "run.max_minutes=30", "--set", "eval.num_problems=18",
            "--set", f"pool.threads_per_worker={threads}"]
    for item in extra:
        args += ["--set", item]
    print(f"[{mode}] {' '.join(args[1:])}", flush=True)
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
        raise SystemExit(f"the {mode} run failed with exit code {result.returncode}")
    seconds = rl_phase_seconds(run_dir)
    print(f"[{mode}, {threads} thread(s) per worker] RL phase {seconds:.1f} s for {steps} steps per model", flush=True)
    return seconds, json.loads((run_dir / "run_result.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="learner steps per model (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="8 steps")
    parser.add_argument("--models", type=int, default=1, choices=(1, 2),
                        help="1: the smoke workload's first model alone (default); 2: both models, which in sync mode "
                             "already keep both cores of a 2-core machine busy")
    parser.add_argument("--task", default="arithmetic", choices=("arithmetic", "countdown"),
                        help="arithmetic: the smoke task (answers of 1-3 tokens, so generation is cheap next to "
                             "training); countdown: expressions of 5-10 tokens (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for both runs (repeatable)")
    args = parser.parse_args(argv)
    steps = 8 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="async-speedup-") as tmp:
        config = workload(args.models, args.task, Path(tmp))
        syncs = {t: run_once("sync", steps, config, args.overrides, t) for t in (1, 2)}
        sync_threads = min(syncs, key=lambda t: syncs[t][0])
        sync_s, sync_result = syncs[sync_threads]
        async_s, _ = run_once("async", steps, config, args.overrides, 1)
    gen, train = sum(sync_result["gen_busy_s"].values()), sum(sync_result["train_busy_s"].values())
    limit = (gen + train) / max(gen, train)
    speedup = sync_s / async_s
    print(json.dumps({"sync_s": round(sync_s, 3), "async_s": round(async_s, 3), "speedup": round(speedup, 3),
                      "target": TARGET, "sync_threads_per_worker": sync_threads, "async_threads_per_worker": 1,
                      "sync_s_by_threads": {t: round(v[0], 3) for t, v in syncs.items()},
                      "sync_gen_busy_s": round(gen, 2), "sync_train_busy_s": round(train, 2),
                      "workload_limit": round(limit, 3), "fraction_of_limit": round(speedup / limit, 3),
                      "steps": steps, "models": args.models, "task": args.task, "overrides": args.overrides}))
    return 0 if speedup >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
