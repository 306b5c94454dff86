"""launch.py's `pool` subcommand: a run on a worker pool whose roles MWRA moves live."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser("pool", help="train on a pool of workers that MWRA reassigns live (see engine/MWRA.md)")
    pool.add_argument("--config", default="configs/pool.toml", help="TOML run config with a [pool] section")
    pool.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set pool.mode=static (repeatable)")
    pool.add_argument("--run-dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    pool.set_defaults(handler=main)


def run_pool(cfg, pool, run_dir: Path, quiet: bool = False):
    """Warm starts (cached), then the pool run; returns its ``PoolResult``."""
    import uvloop

    from engine.pool import PoolRun
    from engine.supervisor import prepare_models

    preps = prepare_models(cfg, run_dir)
    return uvloop.run(PoolRun(cfg, pool, run_dir, [p.checkpoint for p in preps], quiet=quiet).run())


def main(args: argparse.Namespace) -> int:
    import msgspec

    from engine.configload import ConfigError
    from engine.pool import PoolFailed
    from engine.poolconfig import load_pool_run
    from engine.runfiles import make_run_dir, write_resolved_config
    from engine.supervisor import RunFailed, preflight

    try:
        cfg, pool = load_pool_run(args.config, args.overrides)
        preflight(cfg)
        run_dir = make_run_dir(args.run_dir)
    except (ConfigError, FileExistsError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_resolved_config(cfg, run_dir)
    (run_dir / "pool.json").write_bytes(msgspec.json.encode(pool))
    print(f"run dir: {run_dir}", flush=True)
    try:
        result = run_pool(cfg, pool, run_dir)
    except (RunFailed, PoolFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        (run_dir / "FAILED").write_text(str(exc) + "\n")
        return 1
    print(f"[pool] {result.mode}: {result.useful_prompts} prompts completed by every model in {result.duration_s:.0f}s "
          f"({result.useful_samples_per_s:.2f} useful samples/s); steps {result.steps}; {result.decisions} moves, "
          f"{result.regroups} learner re-formations, {result.handbacks} batches handed back; "
          f"experience lost {result.audit.lost}, duplicated {result.audit.duplicates}", flush=True)
    return 0 if result.audit.ok else 1
