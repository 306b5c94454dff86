"""metrics.jsonl, the run's records: one JSON object a line, appended by every learner, worker and the coordinator,
read by the report, the monitor, the W&B logger, the experiment runner, the Python API's result and the
benchmarks. This module is the file's one writer and one reader (tests/test_layout.py checks that no other module
names the file), so its format lives in one place.

Each line is written with a single ``write`` on a file opened in append mode, so lines from several processes
never interleave (they are far below PIPE_BUF). A reader that follows a live run takes whole lines only (a line
still being written waits for the next read); a torn or foreign line (a run killed mid-write) is counted, never
fatal. Every record has
``time`` and ``model`` ("engine" for the coordinator's); ``event`` says what it is. The records that many readers
take have types here: ``StartRecord`` (a model's warm start), ``FinalRecord`` (a model's end); a learner step's
record (``event`` "step") carries what ``engine.train`` logs, TRL's names included, and stays a dict.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import msgspec

METRICS = "metrics.jsonl"


def metrics_path(run_dir: str | os.PathLike) -> Path:
    """Where a run's records are: ``RUN_DIR/metrics.jsonl``."""
    return Path(run_dir) / METRICS


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not measured"
    return value


class MetricsWriter:
    """Appends records of one model (or "engine") to a run's metrics.jsonl, a line a ``write``."""

    def __init__(self, run_dir: str | os.PathLike, model: str):
        self.path = metrics_path(run_dir)
        self.model = model
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record) -> None:
        line = {"time": round(time.time(), 3), "model": self.model}
        line.update({k: _clean(v) for k, v in record.items()})
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class Read(NamedTuple):
    """What one read found: the records (dicts), the lines that were no record (torn or foreign), and the offset
    the next read of a growing file starts from."""

    records: list[dict]
    skipped: int
    offset: int


def read_records(run_dir: str | os.PathLike, offset: int = 0, *, growing: bool = False) -> Read:
    """A run's records from byte ``offset`` (0: all of it); no file: nothing yet. ``growing`` (a reader that
    follows a live run): a last line without its line break is still being written and waits for the next read;
    otherwise it is read as it is (a run killed mid-write: counted in ``skipped``)."""
    try:
        with open(metrics_path(run_dir), "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return Read([], 0, offset)
    end = data.rfind(b"\n") + 1 if growing else len(data)
    records, skipped = [], 0
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            skipped += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            skipped += 1
    return Read(records, skipped, offset + end)


def has_records(run_dir: str | os.PathLike) -> bool:
    """Whether the run has begun its records (RL began: the warm starts write theirs first)."""
    return metrics_path(run_dir).is_file()


class StartRecord(msgspec.Struct, frozen=True):
    """A model's start of RL: its held-out accuracy after the warm start (None where none was measured)."""

    model: str
    warm_accuracy: float | None = None
    warm_accuracy_stderr: float | None = None


class FinalRecord(msgspec.Struct, frozen=True):
    """A model's end: the step it reached, its final held-out accuracy on ``eval_n`` problems (None when the run
    skipped it) with its standard error and the share of completions cut, and its own samples trained."""

    model: str
    step: int = 0
    accuracy: float | None = None
    accuracy_stderr: float | None = None
    eval_n: int | None = None
    truncated: float | None = None
    own_experiences: int = 0


def starts(records: list[dict]) -> dict[str, StartRecord]:
    """Each model's first ``start`` record (a resumed run logs its own after the first), typed."""
    out: dict[str, StartRecord] = {}
    for rec in records:
        if rec.get("event") == "start" and "model" in rec and rec["model"] not in out:
            out[rec["model"]] = msgspec.convert(rec, StartRecord)
    return out


def finals(records: list[dict]) -> dict[str, FinalRecord]:
    """Each model's last ``final`` record (a resumed run's end replaces an earlier stop's), typed."""
    return {rec["model"]: msgspec.convert(rec, FinalRecord) for rec in records if rec.get("event") == "final"}


def steps(records: list[dict], model: str | None = None) -> list[dict]:
    """The learner step records, of ``model`` alone where given, in the order written."""
    return [r for r in records if r.get("event") == "step" and (model is None or r.get("model") == model)]
