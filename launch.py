"""Mutual RL: the one command.

    python launch.py                      run the default job (configs/default.toml)
    python launch.py run --config F       run a config (configs/pool.toml: MWRA moving 8 workers live)
    python launch.py resume RUN_DIR       continue a stopped or killed run from its checkpoints and log
    python launch.py report RUN_DIR...    report.md with plots of a run (several: overlaid)
    python launch.py monitor RUN_DIR      watch a run live in the browser (a finished one: replayed)
    python launch.py cache [--clear]      the cache of warm starts and converted tokenizers
    python launch.py slurm --nodes N ...  the run on a Slurm allocation: its sbatch script (--dry-run: printed)
    python launch.py experiment GRID      a grid of runs (objectives x seeds x models x tasks) and its results
    python launch.py keys DIR             a CurveZMQ key pair, for an exchange beyond loopback
    python launch.py exchange tail ...    watch the live experience stream
    python launch.py exchange stats ...   message rates per topic
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Mutual RL: post-train heterogeneous language models together with shared experience.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from mutual_rl import cli as training_cli
    from mutual_rl import slurm

    training_cli.add_commands(sub)
    slurm.add_command(sub)
    from exchange import cli as exchange_cli

    exchange_cli.add_commands(sub)
    from experiments import cli as experiment_cli

    experiment_cli.add_commands(sub)
    from monitor import report

    report.add_commands(sub)
    from monitor import cli as monitor_cli

    monitor_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # `python launch.py [--set ...]` runs the default job
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handlers are in place
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
