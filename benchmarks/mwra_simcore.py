"""Discrete-event simulator of a multi-model async RL cluster, driven by engine.controller.

A worker is one GPU. It is a generator of one model (decodes a block of prompts at a
time, G samples each) or a data-parallel rank of one model's learner group (the group
trains one step of ``train_batch_blocks`` blocks at a time, split evenly over its ranks).

The run trains every model on the same ``n_steps * train_batch_blocks`` blocks of
prompts. A block becomes trainable when EVERY model has generated it (the cross-model
group is complete; learners wait for their peers' results). A generator may start block
b only while b < (blocks trained by the slowest learner) + ``window_blocks``: the
staleness bound that keeps generators from running away from learners. The run ends
when the slowest learner has trained the last block; useful throughput is the samples
of all models over that time, so every sample counted completes a cross-model group.

Reassignment takes effect at step boundaries: a generator finishes its block, a learner
rank leaves when its group's step ends; the group then stalls while its process group
re-forms. Switch costs are in ``benchmarks.mwra_costs``.

Under MWRA the simulator emits real ``exchange.protocol.Stats`` every ``stats_window_s``
from every worker, builds the view with ``engine.controller.view_from_stats`` and calls
``engine.controller.decide``: the same code the engine runs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from benchmarks.mwra_costs import (GENERATOR_START_S, LEARNER_JOIN_S, LEARNER_REFORM_S, MODELS,
                                   BlockCosts)
from engine.schedule.allocation import pool_key
from engine.schedule.controller import (ControllerConfig, ControllerState, decide, initial_assignment,
                               view_from_stats)
from exchange.protocol import SCHEMA_VERSION, Stats


@dataclass(frozen=True)
class SimConfig:
    n_workers: int
    n_steps: int  # learner steps per model in the run
    block_prompts: int = 8
    train_batch_blocks: int = 4  # blocks per learner step
    window_blocks: int = 8  # staleness window: generators' lead over the slowest learner
    stats_window_s: float = 60.0


def sim_config(n_workers: int, n_steps: int) -> SimConfig:
    """Batch scales with the cluster, as it does in practice: ~2 prompts per GPU per step."""
    batch = max(4, n_workers // 4)
    return SimConfig(n_workers=n_workers, n_steps=n_steps, train_batch_blocks=batch, window_blocks=4 * batch)


@dataclass
class _Worker:
    wid: str
    role: str
    model: str
    status: str = "wait"  # wait | busy | switch | join | member
    pending: tuple[str, str] | None = None
    target: tuple[str, str] | None = None  # role being switched into
    since: float = 0.0
    rate: float = 0.0  # samples/s while busy
    trate: float = 0.0  # tokens/s while busy
    busy: float = 0.0
    idle: float = 0.0
    done: float = 0.0
    tokens: float = 0.0


@dataclass
class _Group:
    model: str
    members: list[str] = field(default_factory=list)
    joiners: list[str] = field(default_factory=list)
    status: str = "wait"  # wait | busy | reform
    trained: int = 0  # blocks
    since: float = 0.0
    rate: float = 0.0
    peer_wait: bool = False
    busy: float = 0.0
    idle: float = 0.0
    done: float = 0.0
    peer_wait_s: float = 0.0


@dataclass
class SimResult:
    run_time_s: float
    useful_samples: int
    throughput: float  # useful samples per second
    moves: int  # worker reassignments carried out
    timeline: list[tuple[float, dict[str, int]]]  # (time, assigned workers per pool)
    decisions: list[dict]  # Decision.to_record() of every decision that moved workers


class Simulation:
    """One run: ``Simulation(cfg, costs, controller=...).run()``; static if ``static_counts`` given."""

    def __init__(self, cfg: SimConfig, costs: BlockCosts, *, controller: ControllerConfig | None = None,
                 static_counts: dict[str, int] | None = None) -> None:
        if (controller is None) == (static_counts is None):
            raise ValueError("give exactly one of controller= (MWRA) or static_counts= (fixed split)")
        self.cfg, self.costs, self.controller = cfg, costs, controller
        self.models = [m.name for m in MODELS]
        self.G = {m.name: m.group_size for m in MODELS}
        self.n_blocks = cfg.n_steps * cfg.train_batch_blocks
        assert len(costs.gen[self.models[0]]) >= self.n_blocks, "costs cover fewer blocks than the run"
        ids = [f"w{i:03d}" for i in range(cfg.n_workers)]
        if static_counts is not None:
            it = iter(ids)
            self.assignment = {next(it): tuple(k.split(":", 1)) for k in sorted(static_counts)
                               for _ in range(static_counts[k])}
        else:
            self.assignment = initial_assignment(ids, controller)
        self.workers = {w: _Worker(w, r, m) for w, (r, m) in self.assignment.items()}
        self.groups = {m: _Group(m) for m in self.models}
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.next_block = {m: 0 for m in self.models}
        self.gen_count = np.zeros(self.n_blocks, dtype=np.int8)
        self.gen_done = {m: 0 for m in self.models}
        self.complete: list[int] = []
        self.waiting = {m: set() for m in self.models}
        self.moves = 0
        self.state = ControllerState()
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.decisions: list[dict] = []

    # --- event plumbing
    def _push(self, t: float, kind: str, arg) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, arg))

    def run(self) -> SimResult:
        for w in sorted(self.workers.values(), key=lambda w: w.wid):
            if w.role == "learner":
                w.status = "member"
                self.groups[w.model].members.append(w.wid)
            else:
                self._worker_next(w)
        if self.controller is not None:
            self._push(self.cfg.stats_window_s, "tick", None)
        self._record()
        handlers = {"gen": self._on_gen, "learn": self._on_learn, "switch": self._on_switch,
                    "reform": self._on_reform, "tick": self._on_tick}
        while min(g.trained for g in self.groups.values()) < self.n_blocks:
            self.now, _, kind, arg = heapq.heappop(self.heap)
            handlers[kind](arg)
        self._record()
        per_block = self.cfg.block_prompts * sum(self.G.values())
        useful = self.n_blocks * per_block
        return SimResult(self.now, useful, useful / self.now, self.moves, self.timeline, self.decisions)

    # --- generators
    def _account(self, w: _Worker) -> None:
        dt = self.now - w.since
        if w.status == "busy":
            w.busy += dt
            w.done += w.rate * dt
            w.tokens += w.trate * dt
        elif w.status == "wait":
            w.idle += dt
        w.since = self.now

    def _may_dispatch(self, m: str) -> bool:
        lead = min(g.trained for g in self.groups.values()) + self.cfg.window_blocks
        return self.next_block[m] < min(self.n_blocks, lead)

    def _worker_next(self, w: _Worker) -> None:
        """A generator between blocks: switch if asked, else take a block, else wait."""
        self._account(w)
        if w.pending is not None:
            self._start_switch(w)
            return
        m = w.model
        if not self._may_dispatch(m):
            w.status = "wait"
            self.waiting[m].add(w.wid)
            return
        b = self.next_block[m]
        self.next_block[m] += 1
        dur = float(self.costs.gen[m][b])
        w.status = "busy"
        w.rate = self.cfg.block_prompts * self.G[m] / dur
        w.trate = float(self.costs.tokens[m][b]) / dur
        self._push(self.now + dur, "gen", (w.wid, b))

    def _on_gen(self, arg) -> None:
        wid, b = arg
        w = self.workers[wid]
        self.gen_done[w.model] += 1
        self.gen_count[b] += 1
        if self.gen_count[b] == len(self.models):
            self.complete.append(b)
            for g in self.groups.values():
                if g.status == "wait":
                    self._try_step(g)
        self._worker_next(w)

    def _wake_generators(self) -> None:
        for m in self.models:
            while self.waiting[m] and self._may_dispatch(m):
                wid = min(self.waiting[m])
                self.waiting[m].discard(wid)
                self._worker_next(self.workers[wid])

    # --- switching
    def _start_switch(self, w: _Worker) -> None:
        self._account(w)
        w.target, w.pending = w.pending, None
        w.status = "switch"
        self.moves += 1
        cost = GENERATOR_START_S if w.target[0] == "generator" else LEARNER_JOIN_S
        self._push(self.now + cost, "switch", w.wid)

    def _on_switch(self, wid: str) -> None:
        w = self.workers[wid]
        w.role, w.model = w.target
        w.since = self.now
        if w.pending is not None and w.pending != w.target:
            self._start_switch(w)
        elif w.role == "generator":
            w.pending = None
            self._worker_next(w)
        else:
            w.pending = None
            w.status = "join"
            g = self.groups[w.model]
            g.joiners.append(wid)
            if g.status == "wait":
                self._try_step(g)

    # --- learners
    def _account_group(self, g: _Group) -> None:
        dt = self.now - g.since
        if g.status == "busy":
            g.busy += dt
            g.done += g.rate * dt
        elif g.status == "wait":
            g.idle += dt
            if g.peer_wait:
                g.peer_wait_s += dt
        g.since = self.now

    def _reform_if_needed(self, g: _Group) -> bool:
        """At a step boundary: let leavers go and joiners in; True if the group now re-forms."""
        leavers = [w for w in g.members if self.workers[w].pending is not None]
        if not leavers and not g.joiners:
            return False
        if len(g.members) - len(leavers) + len(g.joiners) == 0:
            leavers = leavers[1:]  # keep one rank until a replacement has arrived
            if not leavers:
                return False
        self._account_group(g)
        for wid in leavers:
            g.members.remove(wid)
            self._start_switch(self.workers[wid])
        for wid in g.joiners:
            self.workers[wid].status = "member"
            g.members.append(wid)
        g.joiners = []
        g.status = "reform"
        g.busy = g.idle = g.done = g.peer_wait_s = 0.0  # the window's figures belonged to the old group
        self._push(self.now + LEARNER_REFORM_S, "reform", g.model)
        return True

    def _try_step(self, g: _Group) -> None:
        if g.status == "busy" or g.status == "reform":
            return
        self._account_group(g)
        if self._reform_if_needed(g):
            return
        B = self.cfg.train_batch_blocks
        if len(self.complete) - g.trained < B or g.trained >= self.n_blocks:
            g.status = "wait"
            g.peer_wait = self.gen_done[g.model] - g.trained >= B
            return
        blocks = self.complete[g.trained:g.trained + B]
        dur = float(self.costs.train[g.model][blocks].sum()) / len(g.members)
        g.status = "busy"
        g.rate = B * self.cfg.block_prompts * self.G[g.model] / dur
        self._push(self.now + dur, "learn", g.model)

    def _on_learn(self, m: str) -> None:
        g = self.groups[m]
        self._account_group(g)
        g.trained += self.cfg.train_batch_blocks
        g.status = "wait"
        self._wake_generators()
        self._try_step(g)

    def _on_reform(self, m: str) -> None:
        g = self.groups[m]
        g.status = "wait"
        g.since = self.now
        self._try_step(g)

    # --- controller
    def _stats(self) -> list[Stats]:
        out = []
        for w in self.workers.values():
            if w.role != "generator" or w.status in ("switch", "join", "member"):
                continue
            self._account(w)
            win = w.busy + w.idle
            if win >= 1.0:
                out.append(Stats(schema=SCHEMA_VERSION, worker_id=w.wid, role="generator", model=w.model,
                                 time=self.now, window_s=win, samples_per_s=w.done / win,
                                 tokens_per_s=w.tokens / win, idle_frac=w.idle / win))
            w.busy = w.idle = w.done = w.tokens = 0.0
        for g in self.groups.values():
            self._account_group(g)
            win = g.busy + g.idle
            n = len(g.members)
            queue = (len(self.complete) - g.trained) * self.cfg.block_prompts * self.G[g.model]
            if win >= 1.0 and n:
                for wid in g.members:
                    out.append(Stats(schema=SCHEMA_VERSION, worker_id=wid, role="learner", model=g.model,
                                     time=self.now, window_s=win, consumed_per_s=g.done / n / win,
                                     queue_depth=int(queue), idle_frac=g.idle / win,
                                     peer_wait_s=g.peer_wait_s))
            g.busy = g.idle = g.done = g.peer_wait_s = 0.0
        return out

    def _on_tick(self, _) -> None:
        view = view_from_stats(self._stats(), self.assignment, self.now, self.controller)
        decision = decide(view, self.state, self.controller)
        self.state = decision.new_state
        if decision.acted:
            self.decisions.append(decision.to_record())
            for wid, rm in sorted(decision.assignments.items()):
                self.assignment[wid] = rm
                self._reassign(self.workers[wid], rm)
            self._record()
        self._push(self.now + self.cfg.stats_window_s, "tick", None)

    def _reassign(self, w: _Worker, rm: tuple[str, str]) -> None:
        if rm == (w.role, w.model) and w.status != "switch":
            w.pending = None  # moved back before it left: nothing to do
            return
        w.pending = rm
        if w.status == "wait" and w.role == "generator":
            self.waiting[w.model].discard(w.wid)
            self._start_switch(w)
        elif w.status == "join":
            g = self.groups[w.model]
            g.joiners.remove(w.wid)
            self._start_switch(w)
        elif w.status == "member":
            g = self.groups[w.model]
            if g.status == "wait":
                self._try_step(g)
        # busy generators and switching workers pick up ``pending`` when they finish

    def _record(self) -> None:
        counts: dict[str, int] = {}
        for role, model in self.assignment.values():
            key = pool_key(role, model)
            counts[key] = counts.get(key, 0) + 1
        self.timeline.append((self.now, counts))
