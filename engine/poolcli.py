"""launch.py's `pool` subcommand: a run on a worker pool whose roles MWRA moves live."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli import add_run_arguments


def add_commands(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser("pool", help="train on a pool of workers that MWRA reassigns live (see engine/MWRA.md)")
    add_run_arguments(pool, "configs/pool.toml", "TOML run config with a [pool] section", "pool.mode=static")
    pool.set_defaults(handler=main)


def run_pool(cfg, pool, run_dir: Path, quiet: bool = False, evaluate: bool = False):
    """Warm starts (cached), then the pool run; returns its ``PoolResult``.

    ``evaluate``: afterwards, the held-out accuracy of every model's final checkpoint
    against its warm start, printed as the engine's summary table.
    """
    import uvloop

    from engine.pool import PoolRun
    from engine.supervisor import prepare_models

    preps = prepare_models(cfg, run_dir)
    result = uvloop.run(PoolRun(cfg, pool, run_dir, [p.checkpoint for p in preps], quiet=quiet).run())
    if evaluate:
        _final_eval(cfg, preps, run_dir, result)
    return result


def _final_eval(cfg, preps, run_dir: Path, result) -> None:
    from engine.display import print_summary
    from engine.evaluation import evaluate_checkpoint

    finals, samples = {}, {}
    print(f"[pool] held-out evaluation of the final checkpoints ({cfg.eval.num_problems} problems each) ...",
          flush=True)
    for m in cfg.models:
        ckpt = run_dir / "checkpoints" / m.name
        samples[m.name] = result.steps[m.name] * cfg.train.prompts_per_step * cfg.train.group_size
        if not (ckpt / "config.json").exists():
            print(f"[pool] {m.name}: no final checkpoint at {ckpt}; not evaluated", file=sys.stderr, flush=True)
            continue
        ev = evaluate_checkpoint(cfg, m, ckpt)
        finals[m.name] = {"accuracy": ev.accuracy, "accuracy_stderr": ev.stderr, "step": result.steps[m.name],
                          "wall_s": result.duration_s}
    print_summary(cfg, preps, finals, samples)


def main(args: argparse.Namespace) -> int:
    import msgspec

    from engine.pool import PoolFailed
    from engine.poolconfig import load_pool_run
    from engine.supervisor import RunFailed, open_run

    opened = open_run(args, load_pool_run)
    if opened is None:
        return 2
    (cfg, pool), run_dir = opened
    (run_dir / "pool.json").write_bytes(msgspec.json.encode(pool))
    try:
        result = run_pool(cfg, pool, run_dir, evaluate=True)
    except (RunFailed, PoolFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        (run_dir / "FAILED").write_text(str(exc) + "\n")
        return 1
    print(f"[pool] {result.mode}: {result.useful_prompts} prompts completed by every model in {result.duration_s:.0f}s "
          f"({result.useful_samples_per_s:.2f} useful samples/s); steps {result.steps}; {result.decisions} moves, "
          f"{result.regroups} learner re-formations, {result.handbacks} work units handed back; "
          f"experience lost {result.audit.lost}, duplicated {result.audit.duplicates}", flush=True)
    if result.lost_workers:
        print(f"[pool] generators that died and were written off: {', '.join(result.lost_workers)} "
              f"({result.audit.regenerated} samples regenerated from their units)", flush=True)
    return 0 if result.audit.ok else 1
