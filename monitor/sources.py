"""Where the monitor's messages come from: a running run's exchange, or a finished run's files.

A running run: the monitor subscribes to the broker's publish side (``endpoints.json``) as a
*lossy* subscriber capped at ``MONITOR_MAX_RATE`` experiences/s, so when it falls behind or the
exchange runs faster than that the broker drops for it (and counts, per
subscriber, in its Stats) instead of slowing anyone; metrics.jsonl is tailed from its first
line. A finished run: its experience log and metrics.jsonl are merged by time and replayed at
``speed`` times the original pace (0: as fast as possible), silences cut to ``MAX_SILENCE_S``. Bad input is a ``MonitorError``
whose message is one sentence naming the path.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import time
import tomllib
from pathlib import Path

from exchange.log import ExperienceLogReader, LogCorrupt
from exchange.protocol import Stats
from exchange.records import has_records, read_records
from exchange.security import ClientKeys, KeyFileError, KeyRefused
from exchange.subscriber import Subscriber
from monitor.live import LiveState
from monitor.rundata import before_rl

MONITOR_MAX_RATE = 500.0  # experiences/s the broker forwards to a monitor; past it the page shows a sample
MAX_SILENCE_S = 2.0  # a replay waits at most this long between two events
ENDED = ("run_result.json", "FAILED", "INTERRUPTED")  # a run that wrote one of these is over


class MonitorError(Exception):
    """Bad input to the monitor: the message is one sentence for the user."""


def is_finished(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ENDED)


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise MonitorError(f"{run_dir}: no such run directory")
    if said := before_rl(run_dir):
        raise MonitorError(said)
    if not has_records(run_dir) and not (run_dir / "endpoints.json").is_file():
        raise MonitorError(f"{run_dir}: not a run directory (neither metrics.jsonl nor endpoints.json)")


def models_of(run_dir: Path) -> list[str]:
    """The run's model names from its config.toml (so the page shows every model before its first sample)."""
    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    return [m["name"] for m in cfg.get("models", []) if isinstance(m, dict) and "name" in m]


def endpoint_of(run_dir: Path) -> tuple[str, ClientKeys | None]:
    """The broker's subscribe address, and the CurveZMQ key files a client uses when the run has keys (a cluster)."""
    path = run_dir / "endpoints.json"
    try:
        found = json.loads(path.read_text())
        keys = ClientKeys(found["curve_secret"], found["curve_server"]) if "curve_secret" in found else None
        return found["subscribe"], keys
    except FileNotFoundError:
        raise MonitorError(f"{path}: missing; the run has not started its exchange yet") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MonitorError(f"{path}: not an endpoints file (no 'subscribe' address)") from None


def read_experiences(run_dir: Path) -> list:
    """Every experience of the log, checked whole before a replay starts (bad input fails here, not midway)."""
    log = run_dir / "experience_log"
    if not log.is_dir():
        return []
    try:
        return list(ExperienceLogReader(log))
    except LogCorrupt as exc:
        text = str(exc)
        if "newer than this reader" in text:
            raise MonitorError(f"{log}: written by a newer version of Mutual RL ({text.split('(', 1)[-1].rstrip(')')});"
                               " upgrade to replay it") from None
        raise MonitorError(f"{log}: damaged ({text}); the run's metrics alone can still be read with "
                           "`launch.py report`") from None


async def replay(state: LiveState, run_dir: Path, speed: float, experiences: list | None = None) -> None:
    """Feed the run's experiences and records in time order, ``speed`` times as fast as they happened."""
    experiences = read_experiences(run_dir) if experiences is None else experiences
    found = read_records(run_dir)
    state.skipped_lines += found.skipped
    records = found.records
    events = heapq.merge(((e.generated_at, 0, i, e) for i, e in enumerate(experiences)),
                         ((r.get("time", 0.0), 1, i, r) for i, r in enumerate(records)
                          if isinstance(r.get("time"), (int, float))))
    first = wall0 = None
    for n, (t, kind, _, item) in enumerate(events):
        if speed > 0:
            first, wall0 = (t, time.monotonic()) if first is None else (first, wall0)
            ahead = wall0 + (t - first) / speed - time.monotonic()
            if ahead > MAX_SILENCE_S:  # a warm start or an evaluation: nothing to watch, cut it short
                wall0 -= ahead - MAX_SILENCE_S
                ahead = MAX_SILENCE_S
            if ahead > 0.005:
                await asyncio.sleep(ahead)
        if n % 2000 == 0:
            await asyncio.sleep(0)  # let the page's server answer during a fast replay
        state.take(item) if kind == 0 else state.record(item)
    state.replay_done = True


async def tail_metrics(state: LiveState, run_dir: Path, poll_s: float = 0.5) -> None:
    """The run's records as they are written (``exchange.records``), each into ``state``."""
    offset = 0
    while True:
        records, skipped, offset = read_records(run_dir, offset, growing=True)
        state.skipped_lines += skipped
        for rec in records:
            state.record(rec)
        await asyncio.sleep(poll_s)


class Attached:
    """A lossy subscription to a running run's broker: everything (experiences, stats, role changes)."""

    def __init__(self, endpoint: str, run_dir: Path, curve: ClientKeys | None = None) -> None:
        self.endpoint, self.run_dir, self.curve = endpoint, run_dir, curve
        self.name = f"monitor-{os.getpid()}"
        try:
            self.sub = Subscriber(endpoint, [""], name=self.name, lossless=False, hwm_frames=16,
                                  max_rate=MONITOR_MAX_RATE, curve=curve)
        except KeyFileError as exc:
            raise MonitorError(str(exc)) from None

    async def ready(self, timeout: float) -> None:
        try:
            await self.sub.ready(timeout)
        except (TimeoutError, KeyRefused):
            self.sub.close()
            where = f"{self.endpoint} (from {self.run_dir / 'endpoints.json'})"
            if self.curve:  # a CurveZMQ broker drops a wrong key's handshake without a word
                raise MonitorError(f"{where}: no answer with the keys {self.curve.secret_file} and "
                                   f"{self.curve.server_public_file}: wrong keys, or the run has ended "
                                   "(replay its files with --replay)") from None
            raise MonitorError(f"{where}: nothing is listening; "
                               "the run has ended or was killed (replay its files with --replay)") from None

    async def feed(self, state: LiveState) -> None:
        """Everything the broker sends, until it says Closing."""
        state.sample_cap = MONITOR_MAX_RATE
        while batch := await self.sub.recv_batch(4096):
            for msg in batch:
                state.take(msg)
                if type(msg) is Stats and msg.role == "broker":
                    state.missed_by(self.name)
        state.replay_done = True  # the broker said Closing: nothing more will come

    def close(self) -> None:
        self.sub.close()
