"""The supervisor: one asyncio (uvloop) process that runs a whole mutual-RL job.

    launch.py run -> main(): config, run dir, warm starts (cached), then Supervisor.run():
        broker (SEE hub) ── one process
        per model: learner (rank 0 of its weight group) + generators (ranks 1..n)
        here: prompt scheduler, live display, child watch, signal handling

Shutdown is always the same path, whatever triggers it (end of the run, time cap,
Ctrl-C/SIGTERM, the broker's death, every model failed): Control(stop) to everyone,
wait for the learners' final records, then stop every child (join, SIGTERM, SIGKILL),
so no process and no socket outlives the run.

A model whose process dies with an error leaves the run alone: Control(stop) to that
model (its learner, if alive, checkpoints what it has), no more prompts for it, and
its peers train solo from then on and say so. The run still exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from engine import actors, weightsync
from engine.config import RunConfig, cache_root, load_run_config, tokenizer_cache
from engine.configload import ConfigError
from engine.display import LiveDisplay, print_summary
from engine.hub import start_hub
from engine.metrics import MetricsTail
from engine.plan import PromptBook, WorkerPlan
from engine.prep import PrepPlan, PrepResult
from engine.runfiles import free_port, make_run_dir, write_resolved_config
from exchange.protocol import SCHEMA_VERSION, Control, PromptBatch, Stats, WeightsReady
from tasks.registry import make_task


class RunFailed(RuntimeError):
    """The run could not complete; the message says which part failed."""


def open_run(args, load=load_run_config) -> tuple[object, Path] | None:
    """Config (``load(path, overrides)``), pre-flight checks, a fresh run dir; bad input: one line, None."""
    try:
        loaded = load(args.config, args.overrides)
        cfg = loaded[0] if isinstance(loaded, tuple) else loaded
        preflight(cfg)
        run_dir = make_run_dir(args.run_dir)
    except (ConfigError, FileExistsError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    write_resolved_config(cfg, run_dir)
    print(f"run dir: {run_dir}", flush=True)
    return loaded, run_dir


def main(args) -> int:
    opened = open_run(args)
    if opened is None:
        return 2
    cfg, run_dir = opened
    try:
        preps = prepare_models(cfg, run_dir)
        import uvloop

        return uvloop.run(Supervisor(cfg, run_dir, preps).run())
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        (run_dir / "FAILED").write_text(str(exc) + "\n")
        return 1


def preflight(cfg: RunConfig) -> None:
    """Fail before starting anything if a tokenizer or the task cannot be loaded."""
    from tokenbridge import TokenizerLoadError, load_tokenizer

    for i, m in enumerate(cfg.models):
        try:
            load_tokenizer(m.tokenizer, tokenizer_cache(cfg))
        except TokenizerLoadError as exc:
            raise ConfigError(f"models.{i}.tokenizer: {exc}") from None
    from tasks.jsonl import TaskFileError

    try:
        make_task(cfg.task)
    except (OSError, ValueError, TaskFileError) as exc:
        raise ConfigError(f"task: {exc}") from None


def prepare_models(cfg: RunConfig, run_dir: Path) -> list[PrepResult]:
    """Warm-start and evaluate every model, one process each, in parallel (cached on disk)."""
    cache = cache_root(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    workers = []
    for i, m in enumerate(cfg.models):
        result_path = run_dir / f".prep-{m.name}.json"
        plan = PrepPlan(config=cfg, model_index=i, cache_dir=str(cache), result_path=str(result_path),
                        progress=sys.stderr.isatty())
        workers.append((result_path, actors.spawn(f"prep-{m.name}", "engine.prep:prepare_model",
                                                  msgspec.msgpack.encode(plan), threads=cfg.train.threads_per_process)))
    print(f"warm start + held-out eval of {len(workers)} models (cached after the first run) ...", flush=True)
    try:
        for _, actor in workers:
            actor.process.join()
    except KeyboardInterrupt:
        actors.stop_all([a for _, a in workers], grace_s=0)
        raise RunFailed("interrupted during the warm start") from None
    results = []
    for path, actor in workers:
        if actor.exitcode != 0 or not path.exists():
            actors.stop_all([a for _, a in workers], grace_s=0)
            raise RunFailed(f"warm start of {actor.name[5:]} failed (exit code {actor.exitcode}); see the messages above")
        results.append(msgspec.json.decode(path.read_bytes(), type=PrepResult))
        path.unlink()
    return results


class Supervisor:
    def __init__(self, cfg: RunConfig, run_dir: Path, preps: list[PrepResult]):
        self.cfg, self.run_dir, self.preps = cfg, run_dir, preps
        self.run_id = run_dir.name
        self.names = [m.name for m in cfg.models]
        self.issued = {n: 0 for n in self.names}
        self.version = {n: 0 for n in self.names}
        self.samples = {n: 0 for n in self.names}
        self.ready: set[str] = set()
        self.expected: set[str] = set()
        self.finals: dict[str, dict] = {}
        self.changed = asyncio.Event()
        self.stopping = False
        self.failure: str | None = None
        self.failed: dict[str, str] = {}  # model -> why it left the run
        self.model_of: dict[str, str] = {}  # actor name -> model (the broker has none)
        self.actors: list[actors.Actor] = []
        self.groups: list[str] = []  # weight-sync group endpoints (their shm slots are removed at the end)
        self.prompts = PromptBook(make_task(cfg.task), cfg.train.prompts_per_step)

    async def run(self) -> int:
        sock_dir = Path(tempfile.mkdtemp(prefix="mrl-"))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self._start(sock_dir)
            await self._supervise()
        finally:
            await self._shutdown()
            shutil.rmtree(sock_dir, ignore_errors=True)
        print_summary(self.cfg, self.preps, self.finals, self.samples)
        failure = self.failure or "; ".join(f"{m} failed: {why}" for m, why in self.failed.items())
        if failure:
            (self.run_dir / "FAILED").write_text(failure + "\n")
            print(f"error: {failure}", file=sys.stderr)
            return 1
        return 0

    def _on_signal(self, sig: int) -> None:
        if self.stopping:  # second Ctrl-C: stop waiting for final evaluations
            self.failure = self.failure or "interrupted twice; stopped without final evaluation"
            for a in self.actors:
                a.process.kill()
        self.stopping = True
        print(f"\n{signal.Signals(sig).name}: stopping (checkpoints and final eval follow; again to abort)", flush=True)
        self.changed.set()

    async def _start(self, sock_dir: Path) -> None:
        # Not "exp.": decoding every experience here would take CPU from the workers; counts come from metrics.
        hub = await start_hub(self.run_dir, sock_dir, ["weights.", "stats"], "supervisor")
        self.actors.append(hub.actor)
        self.broker_in, self.broker_out, self.pub, self.sub = hub.broker_in, hub.broker_out, hub.pub, hub.sub
        (self.run_dir / "endpoints.json").write_text(json.dumps({"publish": self.broker_in, "subscribe": self.broker_out}) + "\n")
        print(f"watch the experience stream: python launch.py exchange tail --connect {self.broker_out}", flush=True)
        threads = self.cfg.train.threads_per_process
        for i, (m, prep) in enumerate(zip(self.cfg.models, self.preps)):
            group = f"tcp://127.0.0.1:{free_port()}"
            self.groups.append(group)
            warm = {"warm_accuracy": prep.warm_accuracy, "warm_accuracy_stderr": prep.warm_accuracy_stderr}
            roles = [("learner", 0)] + [("generator", g) for g in range(m.generators)]
            for role, index in roles:
                plan = WorkerPlan(run_id=self.run_id, run_dir=str(self.run_dir), config=self.cfg, model_index=i,
                                  role=role, worker_index=index, broker_in=self.broker_in, broker_out=self.broker_out,
                                  weight_group=group, warm_checkpoint=prep.checkpoint, warm_eval=warm)
                self.actors.append(actors.spawn(plan.worker_id, f"engine.{role}:run", plan.encode(), threads))
                self.model_of[plan.worker_id] = m.name
                self.expected.add(plan.worker_id)
        self._write_pids()

    def _write_pids(self) -> None:
        """pids.json: which process is which (for operators, and for tests that kill one)."""
        pids = {a.name: a.process.pid for a in self.actors}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=1) + "\n")

    async def _supervise(self) -> None:
        display = LiveDisplay(self.cfg, self.preps)
        tasks = [asyncio.create_task(c) for c in (self._listen(), self._schedule(), self._watch(), self._tail(display))]
        deadline = time.time() + self.cfg.run.max_minutes * 60
        try:
            while not self.stopping and not all(self._settled(n) for n in self.names):
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=max(0.0, deadline - time.time()))
                except TimeoutError:
                    print(f"\nrun.max_minutes={self.cfg.run.max_minutes} reached: stopping", flush=True)
                    break
            await self._send_stop()
            await self._await_finals(timeout=300)
        finally:
            for t in tasks:
                t.cancel()
            display.close()

    def _settled(self, model: str) -> bool:
        """Nothing more will come from this model: it reported its final record, or it failed and its learner is gone."""
        learner = next(a for a in self.actors if self.model_of.get(a.name) == model and ".l" in a.name)
        return model in self.finals or (model in self.failed and not learner.alive)

    async def _send_stop(self) -> None:
        self.stopping = True
        for name in self.names:  # learners first: they checkpoint and evaluate
            await self.pub.send(Control(schema=SCHEMA_VERSION, command="stop", target=name, reason="end of run"))
        await self.pub.flush()

    async def _await_finals(self, timeout: float) -> None:
        deadline = time.time() + timeout
        learners = [a for a in self.actors if ".l" in a.name]
        while not all(self._settled(n) for n in self.names) and time.time() < deadline:
            if all(not a.alive for a in learners) or self.failure:
                break
            await asyncio.sleep(0.2)

    async def _shutdown(self) -> None:
        try:
            await self.pub.send(Control(schema=SCHEMA_VERSION, command="stop", target="*", reason="shutdown"))
            await asyncio.wait_for(self.pub.flush(), timeout=5)
        except Exception:
            pass  # the broker may already be gone; stop_all below still ends every child
        await asyncio.to_thread(actors.stop_all, self.actors, 15.0)
        for group in self.groups:  # a learner that was killed could not remove its slots
            for path in weightsync.shm_paths(group):
                Path(path).unlink(missing_ok=True)
        self.sub.close()
        self.pub.close()

    async def _listen(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg, Stats) and msg.worker_id in self.expected and msg.worker_id not in self.ready:
                self.ready.add(msg.worker_id)
                self.changed.set()
            elif isinstance(msg, WeightsReady) and msg.model in self.version:
                self.version[msg.model] = max(self.version[msg.model], msg.version)
                self.changed.set()

    async def _schedule(self) -> None:
        train, sync = self.cfg.train, self.cfg.run.mode == "sync"
        ahead = 1 if sync else train.max_inflight_batches
        while self.ready != self.expected:  # a batch sent before its generator subscribed would be lost
            self.changed.clear()
            await self.changed.wait()
        while not self.stopping:
            for name in self.names:
                while name not in self.failed and self.issued[name] < train.steps and self.issued[name] - self.version[name] < ahead:
                    k = self.issued[name]
                    await self.pub.send(PromptBatch(
                        schema=SCHEMA_VERSION, run_id=self.run_id, batch_id=k, model=name,
                        group_size=train.group_size, problems=self.prompts.batch(k),
                        min_weight_version=k if sync else 0,
                    ))
                    self.issued[name] += 1
            self.changed.clear()
            await self.changed.wait()

    async def _watch(self) -> None:
        """A child that dies with an error takes its model out of the run (the broker: the whole run).

        A learner exits 0 after its final record; anything else that exits during the run failed.
        """
        seen: set[str] = set()
        while True:
            await asyncio.sleep(0.5)
            for actor in self.actors:
                if actor.alive or actor.name in seen:
                    continue
                seen.add(actor.name)
                if actor.exitcode == 0 and (self.stopping or ".l" in actor.name):
                    continue
                why = f"{actor.name} exited with code {actor.exitcode} while the run was going"
                model = self.model_of.get(actor.name)
                if model is None or model in self.failed or self.stopping:
                    if model not in self.failed:
                        self.failure = self.failure or why
                        self.stopping = True
                    self.changed.set()
                    continue
                await self._model_failed(model, why)

    async def _model_failed(self, model: str, why: str) -> None:
        """Stop one model; its peers train solo (their learners see the stop and stop waiting for it)."""
        self.failed[model] = why
        survivors = [n for n in self.names if n not in self.failed]
        if not survivors:
            self.failure = "; ".join(f"{m} failed: {w}" for m, w in self.failed.items())
            self.stopping = True
        else:
            print(f"\n[run] {why}: {model} leaves the run (its learner checkpoints what it has); "
                  f"{', '.join(survivors)} {'trains' if len(survivors) == 1 else 'train'} without it", flush=True)
            await self.pub.send(Control(schema=SCHEMA_VERSION, command="stop", target=model, reason=f"failed: {why}"))
            await self.pub.flush()
        self.changed.set()

    async def _tail(self, display: LiveDisplay) -> None:
        tail = MetricsTail(self.run_dir / "metrics.jsonl")
        while True:
            for record in tail.read_new():
                if "own_experiences" in record:  # samples the learner trained on
                    self.samples[record["model"]] = record["own_experiences"]
                if record.get("event") == "final":
                    self.finals[record["model"]] = record
                    self.changed.set()
                display.update(record)
            display.refresh(self.samples)
            await asyncio.sleep(0.5)
