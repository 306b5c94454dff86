"""What a run directory says, read once: its step records per model, evaluations, allocations, result.

Only files are read (``metrics.jsonl``, ``run_result.json``, ``config.toml``), so a report
can be made of a finished run, a failed one, or one still going. Bad input is one
sentence (``ReportError``), never a traceback.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from exchange.records import METRICS, has_records, read_records


class ReportError(Exception):
    """A run directory that cannot be reported on; the message names the path and why."""


@dataclass
class RunData:
    name: str
    path: Path
    objective: str
    models: list[str]
    steps: dict[str, list[dict]] = field(default_factory=dict)  # model -> step records, in order
    starts: dict[str, dict] = field(default_factory=dict)  # model -> its first "start" record
    warm_starts: dict[str, dict] = field(default_factory=dict)  # model -> its first "warm_start" record (the engine's)
    finals: dict[str, dict] = field(default_factory=dict)  # model -> its last "final" record
    allocations: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # resume, worker_lost, peer_gone, ...: one line each
    result: dict | None = None
    t0: float = 0.0  # the first step's time: wall-clock axes start here
    skipped_lines: int = 0  # torn or foreign lines in metrics.jsonl (a run killed mid-write)


NOTABLE = ("resumed", "resume", "worker_lost", "model_left", "peer_gone", "peer_back", "verify_timeout", "truncation")


def before_rl(path: Path) -> str | None:
    """What a run directory holds when its run never reached RL (a stop or a failure in the warm start, or a warm
    start still going), as one sentence; None for any other directory. The launcher made it (config.toml), but
    metrics.jsonl and endpoints.json come with RL: without this it would read as "not a run directory"."""
    if not (path / "config.toml").is_file() or has_records(path) or (path / "endpoints.json").exists():
        return None
    for marker in ("INTERRUPTED", "FAILED"):
        if (path / marker).is_file():
            why = ((path / marker).read_text().strip() or marker.lower()).splitlines()[0].split(";")[0]
            return f"{path}: this run ended before RL began ({why}); nothing to show"
    return f"{path}: this run has not begun RL yet (its warm start is under way, or it was killed); nothing to show yet"


def read_run(path: str | Path) -> RunData:
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such run directory")
    if said := before_rl(path):
        raise ReportError(said)
    if not has_records(path):
        raise ReportError(f"{path}: not a run directory (no {METRICS})")
    config = _config(path)
    models = [m.get("name", "?") for m in config.get("models", [])]
    run = RunData(name=path.name, path=path, objective=config.get("objective", {}).get("kind", "?"), models=models)
    found = read_records(path)
    run.skipped_lines = found.skipped
    for rec in found.records:
        _take(run, rec)
    if not any(run.steps.values()):
        raise ReportError(f"{path}: metrics.jsonl holds no learner step yet")
    run.t0 = min(recs[0]["time"] for recs in run.steps.values() if recs)
    result = path / "run_result.json"
    if result.is_file():
        try:
            run.result = json.loads(result.read_text())
        except json.JSONDecodeError:
            run.result = None
    return run


def _take(run: RunData, rec: dict) -> None:
    event, model = rec.get("event"), rec.get("model")
    if event == "step" and model:
        run.steps.setdefault(model, []).append(rec)
        if model not in run.models:
            run.models.append(model)
    elif event == "start" and model and model not in run.starts:
        run.starts[model] = rec
    elif event == "warm_start" and model and model not in run.warm_starts:
        run.warm_starts[model] = rec
    elif event == "final" and model:
        run.finals[model] = rec
    elif event == "allocation":
        run.allocations.append(rec)
    elif event in NOTABLE:
        run.events.append(rec)


def _config(path: Path) -> dict:
    try:
        return tomllib.loads((path / "config.toml").read_text())
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ReportError(f"{path / 'config.toml'}: not valid TOML ({exc})") from None


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(own samples trained, value) of every record that has ``key``."""
    pts = [(r.get("own_experiences", 0), r[key]) for r in records if r.get(key) is not None]
    return [x for x, _ in pts], [y for _, y in pts]
