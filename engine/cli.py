"""launch.py's `run` subcommand: load a config, start the supervisor."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="train the models of a config together (the default command)")
    add_run_arguments(run, "configs/default.toml", "TOML run config", "train.steps=50")
    run.set_defaults(handler=_run)


def add_run_arguments(parser: argparse.ArgumentParser, config: str, what: str, example: str) -> None:
    """--config, --set and --run-dir: what every training subcommand takes."""
    parser.add_argument("--config", default=config, help=f"{what} (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")
    parser.add_argument("--run-dir", default=None, help="where the run writes (default: runs/<timestamp>)")


def _run(args: argparse.Namespace) -> int:
    from engine.supervisor import main as supervisor_main

    return supervisor_main(args)
