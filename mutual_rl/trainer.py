"""``Trainer``: one run (every model of a config, trained together) from Python, as ``launch.py run`` does it.

The config comes from a TOML file, a dict shaped like one, or a ``RunConfig``, and keyword arguments name whole
sections to change (``train={"steps": 20}``), checked as the file is, each error one line naming the argument.
``train()`` runs the warm starts, the RL phase, the final evaluations and the report in this process's
children, and returns a ``TrainResult``. From a script it runs on this thread; inside a running event loop (a
notebook) on a thread of its own, while this one waits: Ctrl-C (a notebook's interrupt) stops the run as in a
terminal, with checkpoints and final evaluations, and ``train()`` returns what was trained. Callbacks see each
learner step, each evaluation and the end, read from the run's ``metrics.jsonl`` as it is written.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec

from engine import session
from engine.config import ConfigError, RunConfig, config_from_tree
from engine.config.load import Origin, read_toml
from engine.config.trl_names import TRL_NAMES, trl_hint
from mutual_rl.inputs import Inputs, remove_inputs, resolved
from mutual_rl.reward_check import check_rewards

Callback = Callable[[dict], None]
FOLLOW_EVERY_S = 0.2


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
    """How the run ended (``status``: "finished", "interrupted" or "failed", ``error`` saying why it failed), its
    exit code as ``launch.py`` gives it, each model's figures, and where it wrote."""

    status: str
    exit_code: int
    models: dict[str, ModelResult]
    run_dir: Path
    report: Path | None
    error: str | None = None


class TrainingFailed(RuntimeError):
    """``train(raise_on_failure=True)``'s error for a run that failed; ``result`` is what ``train`` returns."""

    def __init__(self, message: str, result: TrainResult) -> None:
        super().__init__(message)
        self.result = result


class ApiOrigin(Origin):
    """Where a key came from, said in the caller's words: ``Trainer(train=...)`` or the config file."""

    def of(self, key: str) -> str:
        said = super().of(key)
        return said.replace("--set ", "Trainer(", 1) + ")" if said.startswith("--set ") else said


class Trainer:
    """Trains the models of a config together: ``Trainer("configs/smoke.toml", train={"steps": 20}).train()``.

    ``config``: a TOML path, a dict of sections, or a ``RunConfig``; ``run_dir``: where the run writes (default
    runs/<timestamp>); ``callbacks``: functions called with each ``metrics.jsonl`` record of a learner step
    (``event`` "step", with ``accuracy`` when it was evaluated), of a final evaluation ("final") and, last, with
    ``{"event": "end", "result": TrainResult}``; ``quiet``: no live display; ``reward_nan``: ``reward.nan``, what
    a NaN from a reward function is ("error" by default, "abstain"); ``success``: ``reward.success``, what counts
    as a success (held-out accuracy, SGT, the warm start): by default the task's answer check where the dataset
    has answers; a reward function's name, a number the weighted reward must reach, or a function of TRL's shape
    whose full marks (1.0) are one (it pays nothing); ``sections``: whole config sections,
    merged into the config's (a dict into a table, anything else replacing it). A keyword of TRL's
    (``learning_rate=``, ``output_dir=``, ``args=``) is refused in one line naming its equivalent here."""

    def __init__(self, config: str | Path | dict | RunConfig | None = None, *, run_dir: str | Path | None = None,
                 callbacks: list[Callback] = (), quiet: bool = False, reward_funcs: Any = None,
                 reward_weights: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 reward_nan: str | None = None, success: Any = None, **sections: Any) -> None:
        self.inputs = Inputs(reward_funcs, reward_weights, train_dataset, eval_dataset, reward_nan, success)
        self.config = make_config(config, sections, self.inputs)
        check_rewards(self.config, self.inputs)  # a broken function refused now, not in a generator minutes later
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.callbacks, self.quiet = list(callbacks), quiet

    def train(self, *, node: Any = None, raise_on_failure: bool = False) -> TrainResult:
        """The whole run: warm starts, RL, final evaluations, the report. A config the machine refuses (a
        tokenizer that does not load, a run directory that exists, an estimated peak memory past what is
        available) is one ConfigError before anything runs.
        ``node``: node 0 of a torchrun cluster (``launch.py run`` passes it; ``engine.session.this_node``)."""
        from engine.runtime.rundir import announce, make_run_dir, write_resolved_config

        session.check_memory(self.config)  # before any process: a run that cannot fit starts none
        session.start_actor_server(self.config)  # a config refused in __init__ cost no second interpreter
        run_dir = None
        try:
            if not self.inputs.any:  # refused before anything is written
                session.preflight(self.config, forked=True)
            run_dir = make_run_dir(None if self.run_dir is None else str(self.run_dir)).resolve()
            cfg = self._with_inputs(run_dir)
            if self.inputs.any:  # the inputs are read where the run will read them
                session.preflight(cfg, forked=True)
        except (ConfigError, FileExistsError, OSError) as exc:
            session.stop_actor_server()
            if run_dir is not None:
                remove_inputs(run_dir)  # nothing ran: the run directory is as it was
            raise ConfigError(str(exc)) from None
        write_resolved_config(cfg, run_dir)
        print(announce(cfg, run_dir), flush=True)
        self.trained_dir = run_dir
        result = run_in_place(cfg, run_dir, False, self.callbacks, self.quiet, node)
        if raise_on_failure and result.status == "failed":  # for scripts that must not carry on after one
            raise TrainingFailed(result.error or f"the run failed (exit code {result.exit_code})", result)
        return result

    def save_model(self, output_dir: str | Path, model: str | None = None) -> list[Path]:
        """TRL's ``trainer.save_model(dir)``: the last ``train()``'s final models into ``output_dir``
        (``save_model`` of this module says where each goes); the run keeps its own in ``RUN_DIR/final/``."""
        if getattr(self, "trained_dir", None) is None:
            raise ConfigError("save_model(): nothing trained yet; call train() first")
        return save_model(self.trained_dir, output_dir, model)

    def _with_inputs(self, run_dir: Path) -> RunConfig:
        """The config with its Python inputs written into ``run_dir`` and named there."""
        if not self.inputs.any:
            return self.config
        self.inputs.write(run_dir)
        tree = resolved(msgspec.to_builtins(self.config), run_dir)
        return config_from_tree(tree, ApiOrigin("Trainer()", []), quiet=True)


def save_model(run_dir: str | Path, output_dir: str | Path, model: str | None = None) -> list[Path]:
    """The trained models of a run into ``output_dir``, as ``from_pretrained`` loads them: ``model`` (or a run's
    only model) into ``output_dir`` itself, every model of several into ``output_dir/<model>``. A model with
    LoRA adapters comes merged, with PEFT's adapter files in its ``adapter/`` folder."""
    import shutil

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


def resume(run_dir: str | Path, *, callbacks: list[Callback] = (), quiet: bool = False,
           overrides: list[str] = (), node: Any = None, **changes: Any) -> TrainResult:
    """Continue a stopped, failed or killed run, as ``launch.py resume``; ``changes`` are dotted keys of what
    may change (``**{"train.steps": 800}``), ``overrides`` the same as ``launch.py resume --set`` takes them."""
    said = [*overrides, *(f"{k}={_toml(v)}" for k, v in changes.items())]
    prepared = session.prepare_resume(Path(run_dir), said)
    if isinstance(prepared, str):
        raise ConfigError(prepared)
    return run_in_place(prepared, Path(run_dir), True, list(callbacks), quiet, node)


def make_config(config: str | Path | dict | RunConfig | None, sections: dict[str, Any],
                inputs: Inputs | None = None) -> RunConfig:
    """A validated RunConfig from what ``Trainer`` was given; any problem is one ConfigError."""
    if isinstance(config, RunConfig):
        tree, where = msgspec.to_builtins(config), "the RunConfig given"
    elif isinstance(config, dict):
        tree, where = copy.deepcopy(config), "the config dict given"
    elif config is None:
        tree, where = {}, "Trainer()"
    else:
        tree, where = read_toml(config), str(config)
    applied = []
    for key, value in sections.items():
        if key not in RunConfig.__struct_fields__ and (said := _trl_keyword(key, value)):
            raise ConfigError(said)
        if isinstance(value, msgspec.Struct):
            value = msgspec.to_builtins(value)
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **copy.deepcopy(value)}
        else:
            tree[key] = copy.deepcopy(value)
        applied.append(([key], f"{key}={value!r}"))
    if inputs is not None:
        applied += inputs.apply(tree, sections)
    return config_from_tree(tree, ApiOrigin(where, applied))


_ARGUMENTS = ("run_dir", "quiet", "callbacks", "reward_funcs", "reward_weights", "train_dataset", "eval_dataset")


def _trl_keyword(key: str, value: Any) -> str | None:
    """The error for a keyword of TRL's (``learning_rate=``, ``output_dir=``, ``args=``) that is no argument of
    ``Trainer``: its name here, written as the keyword to pass where there is one; None for any other keyword."""
    said = trl_hint(key)
    if said is None:
        return None
    here = TRL_NAMES[key].here or ""
    section, _, field = here.partition(".")
    shown = repr(value) if len(repr(value)) <= 40 else "..."
    if section in RunConfig.__struct_fields__ and field.isidentifier():
        said += f": Trainer(..., {section}={{{field!r}: {shown}}})"
    elif here in _ARGUMENTS:
        said += f": Trainer(..., {here}={shown})"
    return f"Trainer({key}=...): not an argument of Trainer; {said}"


def run_in_place(cfg: RunConfig, run_dir: Path, resuming: bool, callbacks: list[Callback], quiet: bool,
                 node: Any = None) -> TrainResult:
    """The run on this thread, or, inside a running event loop, on its own thread while this one waits."""
    follower = MetricsFollower(run_dir, callbacks) if callbacks else None
    run = functools.partial(train_and_report, cfg, run_dir, resuming, node, quiet)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        code = run()
    else:
        code = _run_beside_the_loop(run)
    if follower is not None:
        follower.stop()
    result = read_result(run_dir, code)
    for callback in callbacks:
        call_back(callback, {"event": "end", "result": result})
    return result


def train_and_report(cfg: RunConfig, run_dir: Path, resuming: bool, node: Any, quiet: bool,
                     started: Callable | None = None) -> int:
    """The run (``engine.session.train``), with its W&B logger beside it when ``run.wandb`` is on
    (``monitor.wandb_sink``), then its report: every run that trained at all ends with one unless ``run.report``
    is off, and a report problem never changes the run's exit code."""
    from engine.runtime.rundir import said_size
    from monitor import wandb_sink

    sink = wandb_sink.start(run_dir, cfg.run.wandb)
    try:
        code = session.train(cfg, run_dir, resume=resuming, node=node, quiet=quiet, started=started)
    finally:
        wandb_sink.finish(sink)
    from engine.train.checkpoint import FINAL, export_final

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


class MetricsFollower:
    """Calls ``callbacks`` with each step and final record of ``run_dir/metrics.jsonl`` as it is written."""

    def __init__(self, run_dir: Path, callbacks: list[Callback]) -> None:
        self.path, self.callbacks = run_dir / "metrics.jsonl", callbacks
        self.offset, self.done = self.path.stat().st_size if self.path.exists() else 0, threading.Event()
        self.thread = threading.Thread(target=self._follow, name="mutual-rl-callbacks", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.done.is_set():
            self._read()
            self.done.wait(FOLLOW_EVERY_S)
        self._read()

    def _read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(whole)
        for line in whole.splitlines():
            record = json.loads(line)
            if record.get("event") in ("step", "final"):
                for callback in self.callbacks:
                    call_back(callback, record)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def call_back(callback: Callback, record: dict) -> None:
    """A user's callback, whose exception is one line and never stops the run or the other callbacks."""
    try:
        callback(record)
    except Exception as exc:
        name = getattr(callback, "__qualname__", repr(callback))
        print(f"mutual_rl: callback {name} raised {type(exc).__name__}: {exc} (on a {record.get('event')} record; "
              "ignored)", file=sys.stderr, flush=True)


def read_result(run_dir: Path, code: int) -> TrainResult:
    """The run's figures from its run directory, as the run left them."""
    run_dir = run_dir.resolve()
    finals: dict[str, dict] = {}
    starts: dict[str, dict] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record.get("event") == "final":
            finals[record["model"]] = record
        elif record.get("event") == "start" and "model" in record:
            starts.setdefault(record["model"], record)
    models = {}
    for name in sorted(set(finals) | set(starts)):
        final, start = finals.get(name, {}), starts.get(name, {})
        models[name] = ModelResult(
            accuracy_before=start.get("warm_accuracy"), stderr_before=start.get("warm_accuracy_stderr"),
            accuracy_after=final.get("accuracy"), stderr_after=final.get("accuracy_stderr"),
            eval_n=final.get("eval_n"), steps=int(final.get("step", 0)), samples=int(final.get("own_experiences", 0)))
    failed = run_dir / "FAILED"
    status = "failed" if failed.exists() else "interrupted" if (run_dir / "INTERRUPTED").exists() else "finished"
    report = run_dir / "report.md"
    return TrainResult(status=status, exit_code=code, models=models, run_dir=run_dir,
                       report=report if report.exists() else None,
                       error=failed.read_text().strip() if failed.exists() else None)


def _toml(value: Any) -> str:
    """A value as the TOML literal ``--set`` reads."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)

