"""``launch.py slurm``: a run on a Slurm allocation. The sbatch script starts one launcher per node with srun, in
the environment torchrun would give it (``engine/cluster/node.py``: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``), so node 0's launcher is the coordinator and every other node's a node agent, exactly as
under torchrun. ``--dry-run`` prints the script; otherwise it is written beside the run directory and
submitted with ``sbatch``. The run directory and the cache must be on a filesystem every node mounts.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from mutual_rl.runs import LAUNCH, launch_args


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="render (--dry-run) or submit an sbatch script: one launcher per node by srun")
    p.add_argument("--config", default="configs/default.toml", help="TOML run config (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as `launch.py run --set` (repeatable)")
    p.add_argument("--nodes", type=int, default=1, help="nodes to allocate, one launcher each (default: 1)")
    p.add_argument("--run-dir", default=None, help="where the run writes, on a filesystem every node mounts "
                                                   "(default: runs/<timestamp>)")
    p.add_argument("--partition", default="", help="sbatch --partition")
    p.add_argument("--time", default="", help="sbatch --time, e.g. 04:00:00")
    p.add_argument("--gpus-per-node", type=int, default=0, help="sbatch --gpus-per-node (0: none asked)")
    p.add_argument("--cpus-per-node", type=int, default=0,
                   help="sbatch --cpus-per-task (0: the node's workers x pool.threads_per_worker, plus one)")
    p.add_argument("--sbatch", dest="sbatch_args", action="append", default=[], metavar="ARG",
                   help="one more #SBATCH line, e.g. --sbatch=--account=rl (repeatable)")
    p.add_argument("--keys", default="", help="a directory with the cluster key pair (launch.py keys DIR --name "
                                              "cluster): CurveZMQ between nodes; needed beyond one node unless "
                                              "--insecure")
    p.add_argument("--insecure", action="store_true", help="the nodes' network is private: plain tcp between them")
    p.add_argument("--resume", metavar="RUN_DIR", default="",
                   help="continue this stopped run (launch.py resume RUN_DIR) instead of starting one from --config")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.set_defaults(handler=slurm_command)


class SlurmError(ValueError):
    """What keeps a script from being rendered or submitted, in one line."""


def slurm_command(args: argparse.Namespace) -> int:
    from engine.config import ConfigError
    from mutual_rl.runs import placed_run

    try:
        cfg, run_dir = placed_run(args.config, args.run_dir, args.resume, args.overrides, "--resume ")
        script = render(args, cfg, run_dir)
        if args.dry_run:
            print(script, end="")
            return 0
        job = submit(script, run_dir)
    except (ConfigError, SlurmError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"submitted Slurm job {job}: squeue -j {job}; its output: {output_path(run_dir)}\n"
          f"the run writes to {run_dir} (python launch.py monitor {run_dir} to watch it)")
    return 0


def render(args: argparse.Namespace, cfg, run_dir: Path) -> str:
    """The sbatch script of a run (module doc); a request that cannot run is a SlurmError."""
    nodes = args.nodes
    if nodes < 1:
        raise SlurmError(f"--nodes {nodes}: at least 1")
    if cfg.pool.workers < nodes:
        raise SlurmError(f"--nodes {nodes}: pool.workers = {cfg.pool.workers} leaves a node without a worker")
    if nodes > 1 and not args.keys and not args.insecure:
        raise SlurmError("--nodes > 1: the engine's sockets between nodes need --keys DIR (CurveZMQ; "
                         "python launch.py keys DIR --name cluster) or --insecure on a private network")
    if args.keys and not all((Path(args.keys) / f).is_file() for f in ("cluster.key", "cluster.key_secret")):
        raise SlurmError(f"--keys {args.keys}: no cluster.key and cluster.key_secret there "
                         f"(python launch.py keys {args.keys} --name cluster)")
    if not args.resume and run_dir.exists() and any(run_dir.iterdir()):
        raise SlurmError(f"--run-dir {run_dir}: directory exists and is not empty; choose another")
    per_node = -(-cfg.pool.workers // nodes)
    cpus = args.cpus_per_node or per_node * cfg.pool.threads_per_worker + 1
    lines = ["#!/bin/bash",
             "# Rendered by `python launch.py slurm` (mutual_rl/slurm.py): one launcher per node, started by srun",
             "# with the environment torchrun would give it; node 0's launcher is the coordinator.",
             f"#SBATCH --job-name=mrl-{re.sub(r'[^A-Za-z0-9_.-]+', '-', cfg.run.name)}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --cpus-per-task={cpus}", f"#SBATCH --output={output_path(run_dir)}"]
    lines += [f"#SBATCH --gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []
    lines += [f"#SBATCH --partition={args.partition}"] if args.partition else []
    lines += [f"#SBATCH --time={args.time}"] if args.time else []
    lines += [f"#SBATCH {a}" for a in args.sbatch_args]
    launch = [sys.executable, str(LAUNCH), *launch_args(config=args.config, run_dir=run_dir,
                                                        resume=run_dir if args.resume else None,
                                                        overrides=args.overrides)]
    env = {"MUTUAL_RL_CACHE": str(_cache(cfg))}
    env |= {"MUTUAL_RL_CLUSTER_KEYS": str(Path(args.keys).resolve())} if args.keys else {}
    env |= {"MUTUAL_RL_CLUSTER_INSECURE": "1"} if args.insecure else {}
    lines += ["set -euo pipefail", f"cd {shlex.quote(os.getcwd())}",
              *[f"export {k}={shlex.quote(v)}" for k, v in env.items()],
              "# torchrun's environment: node 0's address and a port for the launchers' one meeting",
              'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
              'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"',
              'export WORLD_SIZE="$SLURM_NNODES" LOCAL_WORLD_SIZE=1',
              "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c "
              + shlex.quote('export RANK="$SLURM_NODEID" LOCAL_RANK=0; exec ' + shlex.join(launch))]
    return "\n".join(lines) + "\n"


def _cache(cfg) -> Path:
    from engine.config import cache_root

    return cache_root(cfg).resolve()


def output_path(run_dir: Path) -> Path:
    """Slurm's own output of the job, beside the run directory (which the run makes itself)."""
    return run_dir.parent / f"{run_dir.name}.slurm-%j.out"


def submit(script: str, run_dir: Path) -> str:
    """``sbatch`` the script (kept beside the run directory); the job id."""
    if shutil.which("sbatch") is None:
        raise SlurmError("sbatch is not on PATH: run this on a Slurm login node, or --dry-run to print the script")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.{'resume.' if (run_dir / 'config.toml').exists() else ''}sbatch"
    path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SlurmError(f"sbatch refused {path}: {said}")
    return done.stdout.strip().split(";")[0]
