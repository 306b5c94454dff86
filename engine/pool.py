"""Pool mode: N worker processes, roles moved live by the MWRA controller.

    PoolRun.run():
        broker (SEE hub) ── one process
        workers w0..wN-1 ── engine.poolworker, one role each (generator / learner rank / idle)
        here: prompt dispatch (pull-based), controller loop, scripted moves, the end-of-run audit

Prompts go out in small work units that generators pull (``engine.pooldispatch``), within
lead limits that keep every model near its own learner and its peers'.

The controller (``engine.controller.decide``) reads the workers' Stats; its moves become
``Assign`` messages (sent in ``Order``s over the pool plane, and published on the
broker), and each acted decision is one ``mwra_decision`` line of metrics.jsonl. A move
that touches a learner group re-forms that group (``Regroup``). A group's leader never
moves while its group exists: a move that names it is given to another member of the
same pool, which is equivalent for the controller and keeps the leader's inbox in place.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from engine import actors
from engine.controller import ControllerState, decide, initial_assignment, view_from_stats
from engine.hub import start_hub
from engine.metrics import MetricsWriter
from engine.plan import PromptBook
from engine.poolaudit import Audit, audit_log
from engine.pooldispatch import Dispatch
from engine.poolconfig import PoolConfig, controller_config
from engine.poolplane import (BatchDone, CoordinatorPlane, GroupFormed, GroupSpec, Halt, HandBack, Hello,
                              LearnerFinal, Order, Regroup, StepDone, WantWork, Work)
from engine.poolworker import PoolWorkerPlan
from engine.runfiles import free_port
from exchange.protocol import SCHEMA_VERSION, Assign, Stats
from tasks.registry import make_task


class PoolFailed(RuntimeError):
    """The pool could not start or finish; the message says which part failed."""


class PoolResult(msgspec.Struct):
    mode: str
    duration_s: float
    useful_prompts: int  # prompts every model generated AND trained on
    useful_samples: int  # useful_prompts * G * number of models
    useful_samples_per_s: float
    steps: dict[str, int]
    decisions: int  # acted controller decisions (+ scripted moves)
    regroups: int
    handbacks: int
    lost_workers: list[str]  # generators that died mid-run (their units were re-issued)
    formations: list[dict]  # per group formation: epoch, step, digests of every rank (equal = bit-identical)
    timeline: list[dict]  # {"t": s, "counts": {pool: workers}}
    audit: Audit


class PoolRun:
    def __init__(self, cfg, pool: PoolConfig, run_dir: Path, warm_checkpoints: list[str], quiet: bool = False):
        self.cfg, self.pool, self.run_dir, self.quiet = cfg, pool, run_dir, quiet
        self.warm = warm_checkpoints
        self.names = [m.name for m in cfg.models]
        self.ccfg = controller_config(cfg, pool)
        self.ids = [f"w{i}" for i in range(pool.workers)]
        self.hello: set[str] = set()
        self.assignment: dict[str, tuple[str, str]] = {}
        self.groups: dict[str, GroupSpec] = {}
        prompts = PromptBook(make_task(cfg.task), cfg.train.prompts_per_step)
        self.dispatch = Dispatch(self.names, prompts, pool, run_dir.name, cfg.train.group_size)
        self.lost_workers: list[str] = []  # generators that died; their units were taken back
        self.trained: dict[str, set[int]] = {m: set() for m in self.names}
        self.finals: dict[str, LearnerFinal] = {}
        self.formations: dict[tuple[str, int], dict] = {}
        self.fresh: list[Stats] = []  # Stats since the controller's last call: each window counts once
        self.cstate = ControllerState()
        self.seq = 0
        self.decisions = self.regroups = 0
        self.timeline: list[dict] = []
        self._last_reasons: list[str] = []
        self.open = asyncio.Event()  # dispatch starts once every first leader has its inbox
        self.changed = asyncio.Event()
        self.actors: list[actors.Actor] = []

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    async def run(self) -> PoolResult:
        sock_dir = Path(tempfile.mkdtemp(prefix="mrl-pool-"))
        try:
            await self._start(sock_dir)
            tasks = [asyncio.create_task(c) for c in (self._listen_plane(), self._listen_stats(), self._watch())]
            try:
                await self._unless_a_worker_dies(self._begin_and_drive(), tasks[-1])
                ended = time.time()
                self.useful_in_budget = set.intersection(*self.trained.values())  # steps after the budget do not count
                await self._halt()
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            await self._shutdown()
            shutil.rmtree(sock_dir, ignore_errors=True)
        return self._result(ended - self.t_start)

    async def _begin_and_drive(self) -> None:
        await self._begin()
        await self._drive()

    @staticmethod
    async def _unless_a_worker_dies(coro, watch: asyncio.Task) -> None:
        """Run ``coro``; if the watch ends first (a worker died), stop it and raise the watch's PoolFailed."""
        work = asyncio.create_task(coro)
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            watch.result()
        work.result()

    async def _start(self, sock_dir: Path) -> None:
        hub = await start_hub(self.run_dir, sock_dir, ["stats"], "pool")
        self.actors.append(hub.actor)
        self.broker_in, self.broker_out, self.pub, self.sub = hub.broker_in, hub.broker_out, hub.pub, hub.sub
        self.plane = CoordinatorPlane(f"ipc://{sock_dir}/plane")
        self.metrics = MetricsWriter(self.run_dir, "mwra")
        for i, wid in enumerate(self.ids):
            plan = PoolWorkerPlan(worker_id=wid, index=i, run_id=self.run_dir.name, run_dir=str(self.run_dir),
                                  config=self.cfg, pool=self.pool, broker_in=self.broker_in,
                                  broker_out=self.broker_out, plane=f"ipc://{sock_dir}/plane",
                                  warm_checkpoints=self.warm)
            self.actors.append(actors.spawn(wid, "engine.poolworker:run", msgspec.msgpack.encode(plan),
                                            self.cfg.train.threads_per_process))
        pids = {a.name: a.process.pid for a in self.actors}  # which process is which (operators, tests)
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=1) + "\n")

    async def _begin(self) -> None:
        deadline = time.time() + 120
        while len(self.hello) < len(self.ids):
            if time.time() > deadline:
                raise PoolFailed(f"workers {sorted(set(self.ids) - self.hello)} never said hello")
            await self._changed(1.0)
        if self.pool.mode == "static":
            it = iter(self.ids)
            self.assignment = {next(it): tuple(k.split(":", 1)) for k, n in sorted(self.pool.static_split.items())
                               for _ in range(n)}
        else:
            self.assignment = initial_assignment(self.ids, self.ccfg)
        self.t0 = time.time()
        for m in self.names:
            members = sorted(w for w, rm in self.assignment.items() if rm == ("learner", m))
            self.groups[m] = GroupSpec(m, 1, f"tcp://127.0.0.1:{free_port()}", members)
        await self._send_orders(dict(self.assignment), "initial split")
        self._log_counts()
        try:
            await asyncio.wait_for(self.open.wait(), self.pool.group_timeout_s)
        except TimeoutError:
            raise PoolFailed("the learner groups did not form in time") from None
        self.t_start = time.time()  # the budget starts when work can flow (costs count from t0, the orders)
        self.dispatch.start_clock(self.t_start)
        for m in self.names:
            self._dispatch(m)

    async def _drive(self) -> None:
        script = sorted(self.pool.script, key=lambda s: s.at_s)
        next_log = time.time() + 5
        while (left := self.t_start + self.pool.duration_s - time.time()) > 0:
            await asyncio.sleep(min(self.pool.controller_every_s, left))
            now = time.time()
            while script and now - self.t_start >= script[0].at_s:
                move = script.pop(0)
                await self._apply({move.worker: (move.role, move.model)}, f"scripted move at {move.at_s:g}s")
            if self.pool.mode == "mwra":
                await self._decide(now)
            for m in self.names:  # a peer may have fallen silent meanwhile: its lead limit no longer holds
                self._dispatch(m)
            self._log_counts()
            if now >= next_log:
                next_log = now + 5
                self.say(f"[pool] t={now - self.t_start:5.1f}s  {self._counts_text()}  steps "
                         + " ".join(f"{m}={self.dispatch.steps[m]}" for m in self.names)
                         + f"  useful prompts {len(set.intersection(*self.trained.values()))}")

    async def _decide(self, now: float) -> None:
        view = view_from_stats(self.fresh, self.assignment, now, self.ccfg)
        self.fresh = []
        decision = decide(view, self.cstate, self.ccfg)
        self.cstate = decision.new_state
        if not decision.acted and decision.reasons != self._last_reasons:
            self.metrics.write(**decision.to_record())  # a no-op is logged when its reasons change
        self._last_reasons = decision.reasons
        if decision.acted:
            self.metrics.write(**decision.to_record())
            self.say(f"[mwra] {'; '.join(decision.reasons)}")
            await self._apply(dict(decision.assignments), "; ".join(decision.reasons))

    async def _apply(self, changes: dict[str, tuple[str, str]], reason: str) -> None:
        changes = self._keep_leaders(changes)
        changes = {w: rm for w, rm in changes.items() if self.assignment.get(w) != rm}
        if not changes:
            return
        self.decisions += 1
        old_groups = dict(self.groups)
        self.assignment.update(changes)
        for w in changes:
            self.dispatch.reassigned(w)
        for m in self.names:
            old = old_groups[m].members
            new = [w for w in old if self.assignment[w] == ("learner", m)]
            new += sorted(w for w, rm in changes.items() if rm == ("learner", m) and w not in old)
            if new != old:
                self.groups[m] = GroupSpec(m, old_groups[m].epoch + 1, f"tcp://127.0.0.1:{free_port()}", new)
                self.regroups += 1
                for w in old:
                    await self.plane.send(w, Regroup(self.groups[m]))
        await self._send_orders(changes, reason)
        self.metrics.write(event="assign", changes={w: list(rm) for w, rm in changes.items()}, reason=reason,
                           groups={m: g.members for m, g in self.groups.items()})

    def _keep_leaders(self, changes: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
        out = dict(changes)
        for m, group in self.groups.items():
            leader = group.members[0] if group.members else None
            if leader in out and out[leader] != ("learner", m):
                stand_ins = [w for w in group.members[1:] if w not in out]
                target = out.pop(leader)
                if stand_ins:
                    out[stand_ins[-1]] = target
                    self.cstate.moved_at[stand_ins[-1]] = time.time()
                else:
                    self.say(f"[pool] not moving {leader}: it leads {m}'s learner group and no member can stand in")
        return out

    async def _send_orders(self, changes: dict[str, tuple[str, str]], reason: str) -> None:
        self.seq += 1
        for w, (role, model) in sorted(changes.items()):
            assign = Assign(schema=SCHEMA_VERSION, epoch=self.seq, worker_id=w, role=role, model=model,
                            reason=reason)
            group = self.groups[model] if role == "learner" else None
            await self.plane.send(w, Order(assign, self.t0, group))
            await self.pub.send(assign)

    # --- prompt dispatch (engine.pooldispatch) ---
    def _dispatch(self, m: str) -> None:
        if self.open.is_set():
            for worker, unit in self.dispatch.next_work(m, time.time()):
                asyncio.create_task(self.plane.send(worker, Work(unit)))

    async def _listen_plane(self) -> None:
        while True:
            wid, msg = await self.plane.recv()
            if isinstance(msg, Hello):
                self.hello.add(wid)
            elif isinstance(msg, WantWork):
                if self.assignment.get(wid) == ("generator", msg.model):
                    self.dispatch.want(wid, msg.model)
            elif isinstance(msg, HandBack):
                self.dispatch.handed_back(wid, msg.batch)
            elif isinstance(msg, BatchDone):
                self.dispatch.done(wid, msg.model, msg.prompt_ids)
                if msg.params_digest:
                    self.metrics.write(event="generator_weights", worker=wid, gen_model=msg.model,
                                       weight_version=msg.weight_version, params_digest=msg.params_digest)
            elif isinstance(msg, StepDone):
                self.dispatch.stepped(msg.model, msg.step, time.time())
                self.trained[msg.model].update(msg.prompt_ids)
            elif isinstance(msg, GroupFormed):
                self._formed(msg)
            elif isinstance(msg, LearnerFinal):
                self.finals[msg.model] = msg
            for m in self.names:
                self._dispatch(m)
            self.changed.set()

    def _formed(self, msg: GroupFormed) -> None:
        rec = self.formations.setdefault((msg.model, msg.epoch), {"model": msg.model, "epoch": msg.epoch,
                                                                  "step": msg.step, "digests": {}})
        rec["digests"][msg.worker_id] = msg.digest
        if msg.rank == 0 and msg.epoch == 1:
            if all((m, 1) in self.formations and self.groups[m].members[0] in self.formations[(m, 1)]["digests"]
                   for m in self.names):
                self.open.set()

    async def _listen_stats(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg, Stats) and msg.worker_id in self.assignment and self.pool.mode == "mwra":
                self.fresh.append(msg)  # static mode never reads them

    async def _watch(self) -> None:
        """A generator that dies is written off and the run goes on; any other death ends it.

        A generator holds nothing but its units, which go back to the queue. A learner
        rank holds training state its group would wait on, and the broker carries all
        experience, so their deaths (or a death mid-switch) stop the run.
        """
        while True:
            await asyncio.sleep(0.5)
            for a in self.actors:
                if a.alive or a.exitcode == 0 or a.name in self.lost_workers:
                    continue
                if self._expendable(a.name):
                    self._lose_generator(a.name, a.exitcode)
                    continue
                print(f"[pool] {a.name} exited with code {a.exitcode}", file=sys.stderr, flush=True)
                raise PoolFailed(f"{a.name} exited with code {a.exitcode} while the run was going")

    def _expendable(self, worker: str) -> bool:
        """A generator in no learner group, leaving enough workers for a generator and a learner per model."""
        return (self.assignment.get(worker, ("", ""))[0] == "generator"
                and all(worker not in g.members for g in self.groups.values())
                and len(self.assignment) - 1 >= 2 * len(self.names))

    def _lose_generator(self, worker: str, exitcode: int) -> None:
        model = self.assignment.pop(worker)[1]
        self.lost_workers.append(worker)
        units = self.dispatch.lost(worker)
        retaken = [p.prompt_id for u in units for p in u.problems]
        print(f"[pool] {worker} (generator of {model}) exited with code {exitcode}: {len(units)} unit(s) go back "
              f"to the queue, the run goes on with {len(self.assignment)} workers", file=sys.stderr, flush=True)
        self.metrics.write(event="worker_lost", worker=worker, role="generator", gen_model=model,
                           exitcode=exitcode, retaken_prompts=retaken)
        self._dispatch(model)

    async def _changed(self, timeout: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass

    # --- the end ---
    async def _halt(self) -> None:
        """Generators first (their last batches reach the log), then learners (they report what is queued)."""
        workers = {a.name: a for a in self.actors}
        gens = [w for w, (r, _) in self.assignment.items() if r != "learner"]
        for w in gens:
            await self.plane.send(w, Halt("end of run"))
        deadline = time.time() + 60
        while any(workers[w].alive for w in gens) and time.time() < deadline:
            await asyncio.sleep(0.2)
        for w, (r, _) in self.assignment.items():
            if r == "learner":
                await self.plane.send(w, Halt("end of run"))
        deadline = time.time() + 60
        while len(self.finals) < len(self.names) and time.time() < deadline:
            await asyncio.sleep(0.2)

    async def _shutdown(self) -> None:
        await asyncio.to_thread(actors.stop_all, [a for a in self.actors if a.name != "broker"], 10.0)
        await asyncio.to_thread(actors.stop_all, [a for a in self.actors if a.name == "broker"], 0.0)
        for closer in (getattr(self, "sub", None), getattr(self, "pub", None), getattr(self, "plane", None)):
            if closer is not None:
                closer.close()
        if hasattr(self, "metrics"):
            self.metrics.close()

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r, m in self.assignment.values():
            counts[f"{r}:{m}"] = counts.get(f"{r}:{m}", 0) + 1
        return counts

    def _counts_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(self._counts().items()))

    def _log_counts(self) -> None:
        t = round(time.time() - getattr(self, "t_start", time.time()), 2)
        self.timeline.append({"t": t, "counts": self._counts()})
        if len(self.timeline) % 5 == 1:
            self.metrics.write(event="allocation", t=t, counts=self._counts())

    def _result(self, duration: float) -> PoolResult:
        useful = self.useful_in_budget
        G = self.cfg.train.group_size
        audit = audit_log(self.run_dir / "experience_log", self.names, G, self.trained,
                          {m: f.queued_prompt_ids for m, f in self.finals.items()}, self.dispatch.done_prompts,
                          self.dispatch.retaken)
        samples = len(useful) * G * len(self.names)
        result = PoolResult(mode=self.pool.mode, duration_s=round(duration, 2), useful_prompts=len(useful),
                            useful_samples=samples, useful_samples_per_s=samples / duration, steps=dict(self.dispatch.steps),
                            decisions=self.decisions, regroups=self.regroups, handbacks=self.dispatch.handbacks,
                            lost_workers=list(self.lost_workers),
                            formations=sorted(self.formations.values(), key=lambda r: (r["model"], r["epoch"])),
                            timeline=self.timeline, audit=audit)
        (self.run_dir / "pool_result.json").write_bytes(msgspec.json.encode(result))
        return result
