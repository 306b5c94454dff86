"""launch.py's engine subcommands: ``run`` (every training job) and ``cache`` (warm starts on disk)."""

from __future__ import annotations

import argparse
import shutil
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="train the models of a config together (the default command)")
    run.add_argument("--config", default="configs/default.toml", help="TOML run config (default: %(default)s)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set train.steps=50 (repeatable)")
    run.add_argument("--run-dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    run.set_defaults(handler=run_command)
    cache = sub.add_parser("cache", help="show (or --clear) the cache of warm starts and converted tokenizers")
    cache.add_argument("--clear", action="store_true", help="delete the cache (it is rebuilt when needed)")
    cache.set_defaults(handler=cache_command)


def open_run(args: argparse.Namespace):
    """Config, pre-flight checks, a fresh run dir; bad input: one line on stderr, nothing written, None."""
    from engine.config import ConfigError, load_run_config
    from engine.runtime.rundir import make_run_dir, write_resolved_config

    try:
        cfg = load_run_config(args.config, args.overrides)
        preflight(cfg)
        run_dir = make_run_dir(args.run_dir)
    except (ConfigError, FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    write_resolved_config(cfg, run_dir)
    print(f"run dir: {run_dir}", flush=True)
    return cfg, run_dir


def preflight(cfg) -> None:
    """Fail before starting anything if a tokenizer or the task cannot be loaded."""
    from engine.config import ConfigError, tokenizer_cache
    from tasks.jsonl import TaskFileError
    from tasks.registry import make_task
    from tokenbridge import TokenizerLoadError, load_tokenizer

    for i, m in enumerate(cfg.models):
        try:
            load_tokenizer(m.tokenizer, tokenizer_cache(cfg))
        except TokenizerLoadError as exc:
            raise ConfigError(f"models.{i}.tokenizer: {exc}") from None
    try:
        make_task(cfg.task)
    except (OSError, ValueError, TaskFileError) as exc:
        raise ConfigError(f"task: {exc}") from None
    if cfg.pool.allocator == "mwra":
        from engine.schedule.allocator import controller_config

        try:
            controller_config(cfg)
        except ValueError as exc:
            raise ConfigError(f"pool.controller: {exc}") from None


def run_command(args: argparse.Namespace) -> int:
    opened = open_run(args)
    if opened is None:
        return 2
    import uvloop

    from engine.coordinator import Coordinator

    cfg, run_dir = opened
    return uvloop.run(Coordinator(cfg, run_dir).run())


def cache_command(args: argparse.Namespace) -> int:
    from engine.config import default_cache_root

    root = default_cache_root()
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    if args.clear:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root} ({size / 1e6:.0f} MB)")
    else:
        entries = sorted(p.name for p in (root / "warmstart").iterdir()) if (root / "warmstart").is_dir() else []
        print(f"{root}: {size / 1e6:.0f} MB, {len(entries)} cached warm starts "
              "(set MUTUAL_RL_CACHE or XDG_CACHE_HOME to move it; `launch.py cache --clear` to delete it)")
    return 0


