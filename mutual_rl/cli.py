"""launch.py's training commands, as users of the Python API: ``run`` (a ``Trainer``), ``resume`` (``resume``),
and ``cache`` (the warm starts on disk). On a torchrun cluster, nodes other than 0 serve node 0's run."""

from __future__ import annotations

import argparse
import shutil
import sys

from engine import session


def add_commands(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="train the models of a config together (the default command)")
    run.add_argument("--config", default="configs/default.toml", help="TOML run config (default: %(default)s)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set train.steps=50 (repeatable)")
    run.add_argument("--run-dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    run.add_argument("--ignore-memory-check", action="store_true",
                     help="start even if the run's estimated peak memory exceeds what is available (it is refused "
                          "otherwise, before anything starts: run.memory_check, run.memory_limit_gib)")
    _ray_arguments(run)
    run.set_defaults(handler=run_command)
    resume = sub.add_parser("resume", help="continue a stopped or crashed run from its checkpoints and experience log")
    resume.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (it holds config.toml)")
    resume.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change what may change mid-run, e.g. --set train.steps=800 to train longer: "
                             + ", ".join(f"{k}*" if k.endswith(".") else k for k in session.RESUMABLE))
    _ray_arguments(resume)
    resume.set_defaults(handler=resume_command)
    cache = sub.add_parser("cache", help="show (or --clear) the cache of warm starts and converted tokenizers")
    cache.add_argument("--clear", action="store_true", help="delete the cache (it is rebuilt when needed)")
    cache.set_defaults(handler=cache_command)


def _ray_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", metavar="ADDRESS", default="",
                   help="place one launcher per node of this Ray cluster (host:port, or auto) with a placement group")
    p.add_argument("--ray-nodes", type=int, default=0, metavar="N", help="with --ray: how many nodes (default: all)")


def run_command(args: argparse.Namespace) -> int:
    """``launch.py run``: the config read with its ``--set`` changes, then the run (``mutual_rl.runs.new_run``, as
    ``Trainer.train`` runs it); bad input is one line on stderr and exit 2, nothing written."""
    from engine.config import load_run_config
    from mutual_rl.runs import new_run

    if args.ignore_memory_check:
        args.overrides = [*args.overrides, "run.memory_check=false"]  # as the config says it (config.toml keeps it)
    if args.ray:
        return _on_ray(args, "run")
    return _on_this_machine(lambda node: new_run(_checked(load_run_config(args.config, args.overrides)),
                                                 args.run_dir, node=node)[0])


def _checked(cfg):
    """The config, its reward functions checked as a Trainer checks them when it is made (a dry call on a few
    problems): a broken one is refused now, not in a generator minutes later."""
    from mutual_rl.inputs import Inputs
    from mutual_rl.reward_check import check_rewards

    check_rewards(cfg, Inputs(None, None, None, None))
    return cfg


def resume_command(args: argparse.Namespace) -> int:
    """``launch.py resume RUN_DIR``: the same config, the same run directory, metrics appended."""
    from mutual_rl.runs import resumed_run

    if args.ray:
        return _on_ray(args, "resume")
    return _on_this_machine(lambda node: resumed_run(args.run_dir, args.overrides, node=node)[0])


def _on_this_machine(start) -> int:
    """``start(node)`` on node 0 (or alone); a torchrun node other than 0 serves node 0's run instead. A bad
    config is one line and exit 2, and the other nodes are told to go."""
    from engine.config import ConfigError

    node = _node()
    if node is not None and node.rank > 0:
        return session.serve_node(node)
    try:
        return start(node)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        session.refuse_nodes(node)
        return 2


def _on_ray(args: argparse.Namespace, command: str) -> int:
    """``--ray``: the config checked here (one line, exit 2, nothing reserved), then a launcher on every node
    (``mutual_rl.ray_launch``), each given the same command with absolute paths."""
    from engine.config import ConfigError
    from mutual_rl.ray_launch import RayPlacementError, run_on_ray
    from mutual_rl.runs import launch_args, placed_run

    resuming = args.run_dir if command == "resume" else ""
    try:
        cfg, run_dir = placed_run(getattr(args, "config", ""), args.run_dir, resuming, args.overrides)
        launch = launch_args(config=getattr(args, "config", None), run_dir=run_dir, resume=resuming,
                             overrides=args.overrides)
        return run_on_ray(args.ray, args.ray_nodes, cfg, launch)
    except (ConfigError, RayPlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _node():
    """This launcher's torchrun node (None on one machine); a launch environment that cannot make a cluster is
    one line and exit 2."""
    from engine.cluster.node import ClusterError

    try:
        return session.this_node()
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cache_command(args: argparse.Namespace) -> int:
    from tokenbridge.cachedir import default_cache_root

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
