"""Weights & Biases logging of a run's metrics (``run.wandb``, or ``launch.py monitor RUN_DIR --wandb``).

One function, ``export``, follows ``RUN_DIR/metrics.jsonl`` (as the monitor tails it) and logs
what TensorBoard gets: the warm-start accuracy, every number of each learner ``step`` record and the
final held-out accuracy, as ``<model>/<tag>`` against that model's own step axis (``<model>/step``),
into one W&B run under ``RUN_DIR/wandb/`` with the run's config.toml as its config. In offline
mode nothing leaves the machine: ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later.

A run with ``run.wandb`` on starts ``export`` in a child process (``start``), niced, outside every
training process: a slow or failing W&B costs training nothing, and its failure is one warning
line. The child follows until its stdin closes (``finish``: the run is over, or the launcher
died), logs the rest, and finishes the W&B run. wandb is imported only here, only when switched on.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from exchange.records import read_records

INSTALL = "pip install -e '.[wandb]'"
FINISH_S = 60.0  # how long the launcher waits for the W&B run to finish after the training run ended
NICE = 10  # as the monitor: on shared cores the run's workers come first
ROOT = Path(__file__).resolve().parents[1]


def tag(key: str) -> str:
    """The TensorBoard tag of a key (engine.record.tbevents.scalar_tag): held-out accuracy under ``eval/``."""
    return f"eval/{key}" if "accuracy" in key and "/" not in key else key


def row(rec: dict) -> dict | None:
    """The W&B row of a metrics.jsonl record, as the learner gives TensorBoard: a model's warm-start accuracy
    (``start``), its step records, its final held-out accuracy and cut share (``final``); None for any other record."""
    model, event, step = rec.get("model"), rec.get("event"), rec.get("step")
    if not isinstance(model, str) or not isinstance(step, int) or event not in ("start", "step", "final"):
        return None
    if event == "start":
        rec = {k: rec.get(k) for k in ("warm_accuracy", "warm_accuracy_stderr")}
    elif event == "final":
        rec = {"final_accuracy": rec.get("accuracy"), "final_accuracy_stderr": rec.get("accuracy_stderr"),
               "final_truncated": rec.get("truncated")}
    values = {f"{model}/{tag(k)}": v for k, v in rec.items() if k not in ("time", "step") and not isinstance(v, bool)
              and isinstance(v, int | float) and math.isfinite(v)}
    return {f"{model}/step": step, **values} if values else None


def export(run_dir: Path, mode: str, ended: Callable[[], bool], poll_s: float = 1.0) -> Path | None:
    """Log metrics.jsonl to a W&B run until ``ended()`` (checked before each read, so the last read sees it
    all), then finish it; its directory, or None after a warning line (W&B failing never raises here)."""
    run = None
    try:
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                  disable_git=True, x_disable_machine_info=True)  # metrics only, no banner
        config = _config(run_dir)
        run = wandb.init(dir=str(run_dir), mode=mode, project=os.environ.get("WANDB_PROJECT", "mutual-rl"),
                         name=run_dir.resolve().name, group=config.get("run", {}).get("name"), config=config,
                         settings=settings)  # run.name groups the runs of one config (seeds, resumes)
        offset, models = 0, set()
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C on `monitor --wandb`: finish what was logged
            while True:
                last = ended()
                records, _, offset = read_records(run_dir, offset, growing=True)
                for rec in records:
                    if (values := row(rec)) is None:
                        continue
                    if rec["model"] not in models:  # each model on its own step axis: they step at their own pace
                        models.add(rec["model"])
                        run.define_metric(f"{rec['model']}/step")
                        run.define_metric(f"{rec['model']}/*", step_metric=f"{rec['model']}/step")
                    run.log(values)
                if last:
                    break
                time.sleep(poll_s)
        run.finish()
        # offline, finish() returns before W&B's service has written the log's tail (seen: a header-only
        # file): tearing the service down waits for it, so the run on disk is whole when we say where it is
        wandb.teardown()
        return Path(run.settings.sync_dir)
    except Exception as exc:  # noqa: BLE001 - W&B is a side channel: one line, never the run's failure
        print(f"warning: W&B logging of {run_dir} stopped: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr, flush=True)
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
        return None


def logged(run_dir: Path, mode: str, where: Path) -> str:
    """The one line that says where the W&B run is (and how to upload it, offline)."""
    return f"W&B: {run_dir} logged to {where}" + (f"; upload it with `wandb sync {where}`" if mode == "offline" else "")


def _config(run_dir: Path) -> dict:
    try:
        return tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def start(run_dir: Path, mode: str) -> subprocess.Popen | None:
    """The run's W&B logger, a child process following ``run_dir``; None when ``run.wandb`` is off."""
    if mode == "off":
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:  # its own session: a Ctrl-C meant for the run reaches neither it nor wandb's service process
        return subprocess.Popen([sys.executable, "-m", "monitor.wandb_sink", str(run_dir), mode],
                                stdin=subprocess.PIPE, env=env, start_new_session=True)
    except OSError as exc:
        print(f"warning: W&B logging of {run_dir} did not start: {exc}", file=sys.stderr, flush=True)
        return None


def finish(proc: subprocess.Popen | None, timeout_s: float = FINISH_S) -> None:
    """Tell the logger the run is over (its stdin closes) and wait for it to finish its W&B run."""
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"warning: W&B logging did not finish within {timeout_s:g}s and was stopped; "
              "RUN_DIR/wandb/ keeps what it had written", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Child entry: ``python -m monitor.wandb_sink RUN_DIR MODE``; follows the run until stdin closes."""
    if len(argv) != 2 or argv[1] not in ("offline", "online"):
        print("usage: python -m monitor.wandb_sink RUN_DIR offline|online (stdin open while the run goes)",
              file=sys.stderr)
        return 2
    run_dir, mode = Path(argv[0]), argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher decides when we stop: it closes our stdin
        signal.signal(sig, signal.SIG_IGN)  # (or it died: that closes our stdin too)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    over = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), over.set()), daemon=True).start()
    where = export(run_dir, mode, over.is_set)
    if where is not None:
        print(logged(run_dir, mode, where), flush=True)
    return 0 if where is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
