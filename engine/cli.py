"""launch.py's `run` subcommand: load a config, start the supervisor."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="train the models of a config together (the default command)")
    run.add_argument("--config", default="configs/default.toml", help="TOML run config (default: %(default)s)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set train.steps=50 (repeatable)")
    run.add_argument("--run-dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from engine.supervisor import main as supervisor_main

    return supervisor_main(args)
