"""One run's life, in one place: the checks before anything starts, the actors' fork server, the run directory, the
coordinator's loop (``engine.session.train``), the trackers, the final models, the report and the result; and the
command line that starts a run on another node (Ray, Slurm, the experiment runner).

``Trainer`` (config -> run -> result), ``launch.py run`` / ``resume`` and the cluster launchers are its users:
``new_run`` starts one, ``resumed_run`` continues a stopped one, each returning the exit code ``launch.py`` gives and
the ``TrainResult`` read from the run directory.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec

from engine import session
from engine.config import ConfigError, RunConfig
from engine.config.load import config_path

LAUNCH = Path(__file__).resolve().parents[1] / "launch.py"


class ModelResult(msgspec.Struct, frozen=True):
    """One model's run: held-out accuracy before RL (after its warm start) and after, each with its standard
    error over ``eval_n`` problems; the steps and own samples it trained."""

    accuracy_before: float | None
    stderr_before: float | None
    accuracy_after: float | None
    stderr_after: float | None
    eval_n: int | None
    steps: int
    samples: int


class TrainResult(msgspec.Struct, frozen=True):
    """How the run ended (``status``: "finished", "interrupted" or "failed", ``error`` saying why it failed), each
    model's figures, and where it wrote."""

    status: str
    models: dict[str, ModelResult]
    run_dir: Path
    report: Path | None
    error: str | None = None


def new_run(cfg: RunConfig, run_dir: str | Path | None, *, inputs=None, watch=None, quiet: bool = False,
            node=None) -> tuple[int, TrainResult]:
    """A run of ``cfg`` into ``run_dir`` (default runs/<timestamp>; new or empty). A config the machine refuses (a
    tokenizer that does not load, a run directory that exists, an estimated peak past the memory available) is
    one ConfigError before anything is written. ``inputs``: ``mutual_rl.inputs.Inputs`` (Python functions and
    datasets, written into the run directory and named in its config); ``watch``: ``engine.session.RunWatch``
    (the callbacks); ``node``: node 0 of a torchrun cluster."""
    from engine.record.rundir import announce, make_run_dir, write_resolved_config
    from mutual_rl.inputs import remove_inputs

    session.check_memory(cfg)  # before any process: a run that cannot fit starts none
    with session.actor_server(cfg):
        made = None
        try:
            if inputs is None or not inputs.any:  # refused before anything is written
                session.preflight(cfg, forked=True)
            made = make_run_dir(None if run_dir is None else str(run_dir)).resolve()
            if inputs is not None and inputs.any:  # the inputs are read where the run will read them
                cfg = inputs.written(cfg, made)
                session.preflight(cfg, forked=True)
        except (ConfigError, FileExistsError, OSError) as exc:
            if made is not None:
                remove_inputs(made)  # nothing ran: the run directory is as it was
            raise ConfigError(str(exc)) from None
        write_resolved_config(cfg, made)
        print(announce(cfg, made), flush=True)
        return _in_place(cfg, made, False, watch, quiet, node)


def resumed_run(run_dir: str | Path, overrides: list[str] = (), *, watch=None, quiet: bool = False,
                node=None) -> tuple[int, TrainResult]:
    """A stopped, failed or killed run continued from each model's newest checkpoint, ``overrides`` (``--set``'s
    form) changing what may change; a run that cannot resume is one ConfigError saying why."""
    run_dir = Path(run_dir)
    cfg = session.resume_config(run_dir, list(overrides))
    if isinstance(cfg, str):
        raise ConfigError(cfg)
    with session.actor_server(cfg):
        said = session.prepare_resume(run_dir, cfg, list(overrides))
        if said is not None:
            raise ConfigError(said)
        return _in_place(cfg, run_dir, True, watch, quiet, node)


def _in_place(cfg: RunConfig, run_dir: Path, resuming: bool, watch, quiet: bool, node) -> tuple[int, TrainResult]:
    """The run on this thread, or, inside a running event loop (a notebook), on its own thread while this one
    waits; then its result, and the callbacks' end."""
    run = functools.partial(_train_and_report, cfg, run_dir, resuming, node, quiet, watch=watch)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        code = run()
    else:
        code = _run_beside_the_loop(run)
    result = read_result(run_dir)
    if watch is not None:
        watch.end(result)
    return code, result


def _train_and_report(cfg: RunConfig, run_dir: Path, resuming: bool, node, quiet: bool,
                      started: Callable | None = None, watch=None) -> int:
    """The run (``engine.session.train``), with its W&B logger beside it when ``run.wandb`` is on
    (``monitor.wandb_sink``), then its final models and its report: every run that trained at all ends with one
    unless ``run.report`` is off, and a report problem never changes the run's exit code."""
    from engine.record.rundir import said_size
    from engine.train.checkpoint import FINAL, export_final
    from monitor import wandb_sink

    sink = wandb_sink.start(run_dir, cfg.run.wandb)
    try:
        code = session.train(cfg, run_dir, resume=resuming, node=node, quiet=quiet, started=started, watch=watch)
    finally:
        wandb_sink.finish(sink)
    if [m for m in cfg.names if export_final(run_dir, m) is not None]:  # the newest checkpoint's models, to load
        print(f"final models: {run_dir / FINAL}/<model> (from_pretrained loads each)", flush=True)
    if cfg.run.report:
        from monitor.report import ReportError, write_report

        try:
            print(f"report: {write_report([run_dir])}", flush=True)
        except ReportError:
            pass  # nothing trained (a failed start, a stop in the warm start): nothing to report
    print(said_size(run_dir), flush=True)
    return code


def _run_beside_the_loop(run: Callable[..., int]) -> int:
    """A notebook's loop owns this thread: the run gets its own, and a SIGINT meanwhile (the kernel's interrupt)
    reaches the coordinator as it would from a terminal, through a handler of ours while the run lasts (the
    loop's own would only cancel a task that cannot yield)."""
    held: dict[str, Any] = {"signals": []}
    lock = threading.Lock()

    def deliver(sig: int) -> None:
        with lock:
            if "coordinator" in held:
                held["loop"].call_soon_threadsafe(held["coordinator"].on_signal, sig)
            else:  # the run is still starting: it gets the signal as soon as it can take it
                held["signals"].append(sig)

    def started(loop, coordinator) -> None:
        with lock:
            held.update(loop=loop, coordinator=coordinator)
            for sig in held["signals"]:
                loop.call_soon(coordinator.on_signal, sig)

    def body() -> None:
        try:
            held["code"] = run(started=started)
        except BaseException as exc:  # given back to the caller's thread below
            held["error"] = exc

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda sig, _: deliver(sig)) if main else None
    thread = threading.Thread(target=body, name="mutual-rl-run", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            try:
                thread.join(0.2)
            except KeyboardInterrupt:  # raised by a handler that was not ours (an embedding application's)
                deliver(signal.SIGINT)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    if "error" in held:
        raise held["error"]
    return held["code"]


def read_result(run_dir: Path) -> TrainResult:
    """The run's figures from its run directory, as the run left them."""
    from exchange.records import finals, read_records, starts

    run_dir = run_dir.resolve()
    records = read_records(run_dir).records
    ended, began = finals(records), starts(records)
    models = {}
    for name in sorted(set(ended) | set(began)):
        final, start = ended.get(name), began.get(name)
        models[name] = ModelResult(
            accuracy_before=start and start.warm_accuracy, stderr_before=start and start.warm_accuracy_stderr,
            accuracy_after=final and final.accuracy, stderr_after=final and final.accuracy_stderr,
            eval_n=final and final.eval_n, steps=final.step if final else 0,
            samples=final.own_experiences if final else 0)
    failed = run_dir / "FAILED"
    status = "failed" if failed.exists() else "interrupted" if (run_dir / "INTERRUPTED").exists() else "finished"
    report = run_dir / "report.md"
    return TrainResult(status=status, models=models, run_dir=run_dir, report=report if report.exists() else None,
                       error=failed.read_text().strip() if failed.exists() else None)


def save_model(run_dir: str | Path, output_dir: str | Path, model: str | None = None) -> list[Path]:
    """The trained models of a run into ``output_dir``, as ``from_pretrained`` loads them: ``model`` (or a run's
    only model) into ``output_dir`` itself, every model of several into ``output_dir/<model>``. A model with
    LoRA adapters comes merged, with PEFT's adapter files in its ``adapter/`` folder."""
    from engine.train.checkpoint import FINAL

    final = Path(run_dir) / FINAL
    found = sorted(p.name for p in final.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if final.is_dir() else []
    if not found:
        raise ConfigError(f"{final}: no final model (a run writes one when it ends with a checkpoint)")
    if model is not None and model not in found:
        raise ConfigError(f"save_model(model={model!r}): the run's models are {', '.join(found)}")
    chosen = [model] if model is not None else found
    out = []
    for name in chosen:
        target = Path(output_dir) if len(chosen) == 1 else Path(output_dir) / name
        shutil.copytree(final / name, target, dirs_exist_ok=True)
        out.append(target)
    return out


# --- a run started elsewhere: one command line for Ray, Slurm and the experiment runner ---

def launch_args(*, config: str | Path | None = None, run_dir: str | Path | None = None, resume: str | Path | None = None,
                overrides: list[str] = ()) -> list[str]:
    """What follows ``python launch.py`` (``LAUNCH``) for a run that another process or node starts: ``run`` of
    ``config`` (a path or a shipped config's name) into ``run_dir``, or ``resume`` of a run directory, with
    ``--set`` for each override; every path absolute, so that the command means the same from any folder."""
    sets = [a for o in overrides for a in ("--set", o)]
    if resume:
        return ["resume", str(Path(resume).resolve()), *sets]
    where = ["--run-dir", str(Path(run_dir).resolve())] if run_dir is not None else []
    return ["run", "--config", str(config_path(config).resolve()), *where, *sets]


def placed_run(config: str, run_dir: str | None, resume: str, overrides: list[str], resume_flag: str = ""):
    """The config and absolute run directory of a run that a cluster engine (Ray, Slurm) is about to start:
    ``resume`` names a stopped run (its own config.toml, with ``overrides``), otherwise ``config`` with
    ``overrides`` into ``run_dir`` (default runs/<timestamp>), which must be new or empty. Bad input is a
    ConfigError naming the argument (``resume_flag``, when it has one), raised before anything is reserved."""
    from engine.config import load_run_config
    from engine.record.rundir import run_dir_for

    if resume:
        path = Path(resume).resolve()
        if not (path / "config.toml").is_file():
            raise ConfigError(f"{resume_flag}{resume}: not a run directory (no config.toml)")
        return load_run_config(path / "config.toml", overrides), path
    try:
        path = run_dir_for(run_dir).resolve()
    except FileExistsError as exc:
        raise ConfigError(str(exc)) from None
    return load_run_config(config, overrides), path
