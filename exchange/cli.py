"""launch.py's `exchange` subcommands (tail, stats). Placeholder until the exchange issue lands."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("exchange", help="watch the shared experience exchange")
