"""The coordinator: one asyncio (uvloop) process that runs a whole job, every job.

    launch.py run / mutual_rl.Trainer -> mutual_rl.runs -> engine.session -> Coordinator.run():
        warm starts (cached; one process per model)
        broker (SEE hub) ── one process: experience, Stats, the experience log
        workers w0..wN-1 ── engine.roles.worker: one device each, one role each
        here: the allocator (static | mwra) and scripted moves, work dispatch, learner groups,
              the failure policy, signals, the live display, the end-of-run audit and summary

The end is always the same path, whatever triggers it (``engine.stopping``): generators
halt first, then learners, then every process is stopped, so nothing outlives the run.

One failure policy (``engine.failures``): a dead generator's units go out again and a
fresh worker takes its place; a dead learner rank's group re-forms from the survivors; a model
with no learner left leaves the run and its peers train solo, saying so; a dead broker starts
again (past pool.max_broker_restarts, the run ends). Each is one line on stderr and a record.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import msgspec

from engine.config import RunConfig
from engine.prep.prepare import PrepFailed, PrepResult, prepare_all, record_warm_starts
from engine.roles.plan import WorkerPlan
from engine.runtime import actors
from engine.outcome import prompts_trained_by_all, report, write_result
from engine.cluster.node import ClusterError, Node, client_keys, curve_server, node_of, tcp
from engine.record.display import LiveDisplay
from engine.failures import FailurePolicy, RunFailed
from engine.runtime.hub import start_hub
from exchange.records import MetricsWriter
from engine.cluster.links import start_cluster
from engine.runtime.plane import (CoordinatorPlane, GroupBroken, GroupFormed, HandBack, Hello, LearnerFinal,
                                  PeersGone, RewardFailed, StepDone, UnitDone, WantWork, Work)
from engine.record.rundir import make_sock_dir, write_json, write_pids
from engine.schedule.resume import resume_plan
from engine.schedule.allocator import make_allocator
from engine.schedule.dispatch import Dispatch
from engine.schedule.roster import Roster
from engine.stopping import halt, shutdown
from engine.weights.places import channel_root, weights_board
from exchange.protocol import Stats
from tasks.registry import make_task

PAUSE_SAID_S = 5.0  # a drive-loop turn this much later than its cadence is said on stderr and recorded


class Coordinator:
    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool = False, resume: bool = False,
                 node: Node | None = None, watch=None):
        self.cfg, self.run_dir, self.quiet, self.resuming = cfg, run_dir, quiet, resume
        self.watch = watch  # the caller's hooks (``engine.session.RunWatch``: mutual_rl's callbacks), or None
        self.node = node  # node 0 of a cluster (engine.cluster.node); None on one machine
        self.host = node.master_addr if node else None  # where node 0 listens (tcp); None: ipc
        self.nodes = None  # engine.cluster.links.NodeLink, in a cluster
        self.resume_from: dict[str, str] = {}  # model -> checkpoint, for the workers spawned at the start
        self.names = cfg.names
        self.allocator = make_allocator(cfg, run_dir)  # with the scripted moves (.script)
        self.dispatch = Dispatch(cfg, make_task(cfg.task))
        self.roster = Roster(self.names, host_of=lambda w: self.nodes.address(self.place_of[w][0]) if self.nodes
                             else "127.0.0.1")  # a group's rendezvous is on its leader's machine
        self.failures = FailurePolicy(self)
        self.actors: dict[str, actors.Actor] = {}
        self.place_of: dict[str, tuple[int, int]] = {}  # worker -> (node, device index on that node)
        self.hello: set[str] = set()
        self.trained: dict[str, set[int]] = {m: set() for m in self.names}
        self.last_step_at: dict[str, float] = {}
        self.finals: dict[str, LearnerFinal] = {}
        self.gone: dict[str, str] = {}  # models that send no experience now (finished, failed or silent), why
        self.formations: dict[tuple[str, int], dict] = {}
        self.fresh: list[Stats] = []  # Stats since the allocator's last tick: each window counts once
        self.busy = {"gen": {m: 0.0 for m in self.names}, "train": {m: 0.0 for m in self.names}}
        self.moves, self.timeline = 0, []  # MWRA's moves, and every role change (for the report)
        self.preps: list[PrepResult] = []
        self.interrupted, self.stopping = None, False  # the signal (int) that stopped the run; stopping under way
        self.stopped_by = ""  # who stopped it: the signal's name, or what a watch said
        self.open = asyncio.Event()  # dispatch starts once every first leader has its inbox
        self.changed = asyncio.Event()
        self.t_start = self.t_stop = 0.0

    def say(self, text: str, err: bool = False) -> None:
        if err or not self.quiet:
            print(text, file=sys.stderr if err else sys.stdout, flush=True)

    # --- the whole run ---
    async def run(self) -> int:
        if threading.current_thread() is threading.main_thread():  # else its caller forwards them (mutual_rl)
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, self.on_signal, sig)
        self.sock_dir = make_sock_dir()
        result = None
        try:
            self.prep_actors: list[actors.Actor] = []
            await self._open_plane()
            self.preps = await prepare_all(self.cfg, self.run_dir, self.prep_actors)
            if self.interrupted is None:
                if self.resuming:
                    self.resume_from = resume_plan(self)
                await self._start()
                await self.failures.watching(self._begin_and_drive())
                self.t_stop = time.time()
                self.useful = prompts_trained_by_all(self)  # the useful rate counts these (the stop ends duration_s)
                await halt(self)
                result = write_result(self)
        except (RunFailed, PrepFailed, ClusterError) as exc:
            if self.interrupted is None:
                self.failures.fail(str(exc))
        finally:
            await shutdown(self)
        return report(self, result)

    def on_signal(self, sig: int, by: str | None = None) -> None:
        """Ctrl-C (or a watch's stop, ``by`` naming it, as SIGINT): checkpoints and final evaluations, INTERRUPTED."""
        if self.interrupted is not None:  # a second Ctrl-C: stop waiting for checkpoints and evaluations
            self.failures.aborted = sig  # the user's choice, not a failure: INTERRUPTED, and resumable
            for a in [*self.actors.values(), *getattr(self, "prep_actors", [])]:
                a.process.kill()
            return
        self.interrupted, self.stopped_by = sig, by or signal.Signals(sig).name
        self.interrupted_in = "the warm start" if not self.actors else "the run"
        then = ("nothing to save: a warm start is cached only when complete" if not self.actors
                else "checkpoints and final evaluations follow; again to abort")
        self.say(f"\n{self.stopped_by} during {self.interrupted_in}: stopping ({then})", err=by is not None)
        for a in getattr(self, "prep_actors", []):
            a.process.kill()  # a warm start is cached only when complete: nothing to save
        self.changed.set()

    async def _open_plane(self) -> None:
        """The plane (and, in a cluster, the weight hub and every other node) before anything else."""
        self.curve = curve_server(self.node.keys) if self.node else None  # before any socket of a cluster binds
        self.plane = CoordinatorPlane(f"tcp://{self.host}:*" if self.host else f"ipc://{self.sock_dir}/plane", self.curve)
        self.weights_root = channel_root(self.run_dir.name + f"-{id(self):x}")
        self.board = weights_board(self.cfg, self.host or "127.0.0.1")
        self.tasks = [asyncio.create_task(self._listen_plane())]
        self.tasks[0].add_done_callback(self._task_ended)
        if self.node is not None:
            await start_cluster(self)

    async def _start(self) -> None:
        ends = (tcp(self.host), tcp(self.host)) if self.host else None  # a cluster's node 0: tcp, else ipc
        hub = await start_hub(self.run_dir, self.sock_dir, ["stats"], "coordinator", self.cfg.timeouts.worker_start_s,
                              ends, client_keys(self.node.keys) if self.node else None)
        self.hub = hub
        self.actors["broker"] = hub.actor
        self.broker_in, self.broker_out, self.pub, self.sub = hub.broker_in, hub.broker_out, hub.pub, hub.sub
        write_json(self.run_dir, "endpoints.json", hub.endpoints())
        self.say(f"watch the experience stream: {hub.tail_command()}")
        self.metrics = MetricsWriter(self.run_dir, "engine")
        record_warm_starts(self.metrics, self.preps)
        nodes = self.node.nodes if self.node else 1
        for i in range(self.cfg.pool.workers):
            self.spawn_worker(f"w{i}", node_of(i, self.cfg.pool.workers, nodes))
        self.resume_from = {}  # a worker spawned later (a replacement) joins a group that has the state
        self.tasks.append(asyncio.create_task(self._listen_stats()))
        self.tasks[-1].add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        """A listener of the coordinator must never die quietly: the run would wait for messages forever."""
        if not task.cancelled() and task.exception() is not None:
            traceback.print_exception(task.exception())
            self.failures.fatal = f"the coordinator's {task.get_coro().__name__} failed: {task.exception()!r}"
            self.changed.set()

    def spawn_worker(self, wid: str, place: tuple[int, int], resume: dict[str, str] | None = None) -> None:
        """Start worker ``wid`` at ``place`` (node, device index): here, or through its node's agent."""
        node, device_index = place
        warm_acc = {p.model: [p.warm_accuracy, p.warm_accuracy_stderr] for p in self.preps}
        plan = WorkerPlan(worker_id=wid, device_index=device_index, run_id=self.run_dir.name,
                          run_dir=str(self.run_dir.resolve()), config=self.cfg, broker_in=self.broker_in,
                          broker_out=self.broker_out, plane=self.plane.endpoint,
                          weights_root=str(self.weights_root) if node == 0 else self.nodes.weights_root(node),
                          weights_hub=self.weights_hub.inbound if self.nodes else "", weights_board=self.board[1],
                          curve=self.hub.curve, warm_checkpoints={p.model: p.checkpoint for p in self.preps},
                          warm_accuracy=warm_acc, resume=self.resume_from if resume is None else resume)
        payload, threads = msgspec.msgpack.encode(plan), self.cfg.pool.threads_per_worker
        self.actors[wid] = (actors.spawn(wid, "engine.roles.worker:run", payload, threads) if node == 0
                            else self.nodes.spawn(node, wid, "engine.roles.worker:run", payload, threads))
        self.place_of[wid] = place
        write_pids(self.run_dir, self.actors.values())

    async def _begin_and_drive(self) -> None:
        workers = [f"w{i}" for i in range(self.cfg.pool.workers)]
        await self.wait_until(lambda: self.hello >= set(workers), self.cfg.timeouts.worker_start_s,
                              lambda: f"workers {sorted(set(workers) - self.hello)} never said hello")
        await self.send_all(self.roster.start(self.allocator.initial(workers), time.time()))
        self._log_counts()
        await self.wait_until(self.open.is_set, self.cfg.timeouts.group_form_s,
                              lambda: "the learner groups did not form in time")
        self.t_start = time.time()
        self.last_step_at = {m: self.t_start for m in self.names}
        await self._drive()

    async def wait_until(self, predicate, timeout: float, why) -> None:
        deadline = time.time() + timeout
        while not predicate() and self.interrupted is None and not self.failures.fatal:
            if time.time() > deadline:
                raise RunFailed(why())
            await self.wait_changed(1.0)

    async def _drive(self) -> None:
        display = LiveDisplay(self.cfg, self.preps, enabled=not self.quiet, say=self.say, metrics=self.metrics)
        self.say(LiveDisplay.legend(self.cfg))
        self.display, deadline, next_tick = display, self.t_start + self.cfg.run.max_minutes * 60, 0.0
        last_turn = time.time()
        try:
            while self.interrupted is None and not self.failures.fatal and not self.failures.stop_now:
                running = [m for m in self.names if m not in self.finals and m not in self.failures.left]
                if not running:
                    break
                if all(m in self.dispatch.silent for m in running):  # nothing can progress any more
                    self.failures.fail(f"{', '.join(running)} made no progress for timeouts.peer_silent_s="
                                       f"{self.cfg.timeouts.peer_silent_s:g}s; stopped{self.failures.oom_note()}")
                    break
                now = time.time()
                self._discount_stall(now - last_turn)
                last_turn = now
                if now >= deadline:
                    self.say(f"\nrun.max_minutes={self.cfg.run.max_minutes:g} reached: stopping")
                    break
                if now >= next_tick:
                    next_tick = now + self.cfg.pool.controller_every_s
                    await self._tick(now)
                self.dispatch_all()
                display.refresh(f"[pool] {' '.join(f'{k}={v}' for k, v in sorted(self.roster.counts().items()))}")
                await self.wait_changed(min(self.cfg.pool.controller_every_s, deadline - now))
        finally:
            display.close()

    def _discount_stall(self, gap: float) -> None:
        """Time the coordinator itself did not run (a suspended laptop, a paused VM: every process stopped at
        once) is nobody's silence: the silence timers skip it, so a machine that wakes does not declare every
        model gone."""
        stall = gap - self.cfg.pool.controller_every_s
        if stall <= 0:
            return
        for m in self.last_step_at:
            self.last_step_at[m] += stall
        if stall >= PAUSE_SAID_S:
            self.say(f"[run] the coordinator did not run for {stall:.0f}s (the machine suspended or paused?): "
                     "the silence timers skip that time", err=True)
            self.metrics.write(event="paused", seconds=round(stall, 1))

    async def _tick(self, now: float) -> None:
        for move in self.allocator.script.due(dict(self.dispatch.steps)):
            await self.apply({move.worker: (move.role, move.model)}, f"scripted move at {move.step_of} step {move.at_step}",
                             by_allocator=False)
        leaders = [w for m in self.names if (w := self.roster.leader(m)) is not None]
        changes, reason, records = self.allocator.tick(now, self.fresh, dict(self.roster.assignment), leaders)
        self.fresh = []
        for record in records:
            self.metrics.write(**record)
        if changes:
            self.say(f"[mwra] {reason}")
            await self.apply(changes, reason)
        self._check_silence(now)
        self._log_counts()

    async def apply(self, changes: dict[str, tuple[str, str]], reason: str, by_allocator: bool = True) -> None:
        changes = {w: rm for w, rm in changes.items() if w in self.actors and self.actors[w].alive}  # not the dead
        applied, messages = self.roster.apply(changes, reason, self.allocator.last_moves())
        if not applied:
            return
        self.moves += 1
        for w in applied:
            self.dispatch.reassigned(w)
            if (w not in changes or not by_allocator) and hasattr(self.allocator, "moved"):
                self.allocator.moved(w, time.time())  # a stand-in's or a scripted move: its dwell starts now
        await self.send_all(messages)
        self.metrics.write(event="assign", changes={w: list(rm) for w, rm in applied.items()}, reason=reason,
                           groups={m: g.members for m, g in self.roster.groups.items()})

    async def send_all(self, messages) -> None:
        for worker, msg in messages:
            await self.plane.send(worker, msg)
            if hasattr(msg, "assign"):
                await self.pub.send(msg.assign)  # monitors see every role change on the exchange

    def dispatch_all(self) -> None:
        if self.open.is_set() and not self.stopping:
            for m in self.names:
                for worker, unit in self.dispatch.next_work(m):
                    asyncio.create_task(self.plane.send(worker, Work(unit)))

    def _check_silence(self, now: float) -> None:
        """A model whose learner has not stepped for ``peer_silent_s`` holds nobody back until it steps again."""
        silent = {m for m, t in self.last_step_at.items()
                  if now - t > self.cfg.timeouts.peer_silent_s and m not in self.finals and m not in self.failures.left}
        if silent != self.dispatch.silent:
            for m in sorted(silent - self.dispatch.silent):
                self.say(f"[run] {m}: no learner step for {now - self.last_step_at[m]:.0f}s: presumed gone, "
                         "its peers train without it", err=True)
            self.dispatch.silent = silent
            self.set_gone()

    def set_gone(self) -> None:
        gone = {m: f"no learner step for over {self.cfg.timeouts.peer_silent_s:g}s" for m in self.dispatch.silent}
        gone.update({m: f"finished its {f.step} steps" for m, f in self.finals.items()})
        gone.update(self.failures.left)
        if gone != self.gone:
            self.gone = gone
            for w in self.roster.assignment:
                asyncio.create_task(self.plane.send(w, PeersGone(gone)))

    # --- what the workers say ---
    async def _listen_plane(self) -> None:
        while True:
            wid, msg = await self.plane.recv()
            if self.nodes is not None and self.nodes.take(wid, msg):
                self.changed.set()
                continue
            if isinstance(msg, Hello):
                if self.nodes is not None and self.nodes.said_hello(wid, msg.pid):
                    write_pids(self.run_dir, self.actors.values())
                self.hello.add(wid)
                await self.failures.hello(wid)
            elif isinstance(msg, WantWork):
                if self.roster.assignment.get(wid) == ("generator", msg.model):
                    self.dispatch.want(wid, msg.model)
            elif isinstance(msg, HandBack):
                self.dispatch.handed_back(wid, msg.unit)
            elif isinstance(msg, UnitDone):
                self.dispatch.done(wid, msg.model, msg.prompt_ids)
                self.busy["gen"][msg.model] += msg.busy_s
                self.failures.judged(wid, msg)
                if msg.params_digest:
                    self.metrics.write(event="generator_weights", worker=wid, gen_model=msg.model,
                                       weight_version=msg.weight_version, params_digest=msg.params_digest)
            elif isinstance(msg, StepDone):
                self._stepped(msg)
            elif isinstance(msg, GroupFormed):
                self._formed(msg)
            elif isinstance(msg, GroupBroken):
                await self.failures.broken(msg)
            elif isinstance(msg, RewardFailed):
                self.failures.reward_failed(msg.text)
            elif isinstance(msg, LearnerFinal):
                self.finals[msg.model] = msg
                if self.watch is not None:
                    self.watch.final(msg)
                self.dispatch.leave(msg.model)
                self.set_gone()
            self.dispatch_all()
            self.changed.set()

    def _stepped(self, msg: StepDone) -> None:
        self.dispatch.stepped(msg.model, msg.step)
        self.trained[msg.model].update(msg.prompt_ids)
        self.busy["train"][msg.model] += msg.report.step_s
        self.last_step_at[msg.model] = time.time()
        self.failures.stepped(msg.model)
        if msg.model in self.dispatch.silent:
            self.dispatch.silent.discard(msg.model)
            self.set_gone()
        if hasattr(self, "display"):
            self.display.update(msg.model, msg.step, msg.report)
        if self.watch is not None and self.interrupted is None and (why := self.watch.step(msg.model, msg.step, msg.report)):
            self.on_signal(signal.SIGINT, by=why)  # as Ctrl-C: checkpoints, final evaluations, resumable

    def _formed(self, msg: GroupFormed) -> None:
        rec = self.formations.setdefault((msg.model, msg.epoch), {"model": msg.model, "epoch": msg.epoch,
                                                                  "step": msg.step, "digests": {}})
        rec["digests"][msg.worker_id] = msg.digest
        self.roster.formed(msg.model, msg.epoch, msg.rank)
        leaders = {m: self.roster.leader(m) for m in self.names}
        if all(leaders[m] in self.formations.get((m, 1), {}).get("digests", {}) for m in self.names):
            self.open.set()

    async def _listen_stats(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg, Stats) and msg.worker_id in self.roster.assignment:
                self.fresh.append(msg)

    async def wait_changed(self, timeout: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), max(timeout, 0.0))
        except TimeoutError:
            pass

    def _log_counts(self) -> None:
        """The split into metrics.jsonl (when it changed, and every fifth call) and into allocation.json."""
        self.allocator.keep(self.roster.assignment)
        t = round(time.time() - (self.t_start or time.time()), 2)
        counts = self.roster.counts()
        if not self.timeline or self.timeline[-1]["counts"] != counts or len(self.timeline) % 5 == 0:
            self.timeline.append({"t": t, "counts": counts})
            self.metrics.write(event="allocation", t=t, counts=counts,  # workers: a monitor's timeline starts here
                               workers={w: list(rm) for w, rm in sorted(self.roster.assignment.items())})

