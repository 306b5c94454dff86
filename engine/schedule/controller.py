"""MWRA controller: decide which worker does what, from the Stats stream.

The policy is one pure function, ``decide(view, state, config) -> Decision``: no clock, no
I/O, no randomness, so the engine (``engine.schedule.allocator``) and the cluster simulator
(benchmarks/mwra_simcore.py) drive the same code. How it decides (capacity from busy time,
max-min target split, hysteresis) is written out in engine/MWRA.md.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from engine.schedule.allocation import (bottleneck_rate, max_min_counts, plan_moves, pool_key, pool_rate,
                               split_key)
from exchange.protocol import SCHEMA_VERSION, Assign, Stats

Role = Literal["generator", "learner", "idle"]
IDLE_POOL = "idle:"
_BIG = 1_000_000

PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class ModelLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-model bounds on how many workers each role may hold."""

    name: str
    group_size: Annotated[int, Meta(ge=1)] = 8  # G: samples per prompt, turns samples/s into prompts/s
    min_generators: Annotated[int, Meta(ge=1)] = 1  # a model with no generator never completes a group
    max_generators: Annotated[int, Meta(ge=1)] = _BIG
    min_learners: Annotated[int, Meta(ge=1)] = 1  # a model with no learner never trains
    max_learners: Annotated[int, Meta(ge=1)] = _BIG

    def __post_init__(self) -> None:
        for role in ("generators", "learners"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if lo > hi:
                raise ValueError(f"model {self.name!r}: min_{role} ({lo}) exceeds max_{role} ({hi})")


class ControllerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """MWRA policy settings (the ``[controller]`` table of a run config)."""

    models: list[ModelLimits]
    decision_interval_s: PosFloat = 120.0  # how often a decision may be taken
    cooldown_s: NonNegFloat = 300.0  # after moving workers, let the new split show in the stats
    min_dwell_s: NonNegFloat = 900.0  # a worker keeps a role at least this long (reloads are costly)
    improvement_threshold: NonNegFloat = 0.05  # act only if the slowest pool gets this much faster
    max_move_frac: Annotated[float, Meta(gt=0, le=1)] = 0.25  # at most this share of workers per decision
    ewma_halflife_s: PosFloat = 300.0  # smoothing of capacity estimates: noise vs. drift tracking
    min_busy_s: NonNegFloat = 5.0  # busy time a pool's windows must add up to (across calls) for one estimate
    flood_queue_s: PosFloat = 900.0  # a learner queue beyond this many seconds of work is flooded
    drain_horizon_s: PosFloat = 900.0  # ... and the excess should drain within this long
    stale_stats_s: PosFloat = 600.0  # Stats older than this are ignored

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if not names:
            raise ValueError("controller.models is empty: list at least one model")
        if len(set(names)) != len(names):
            raise ValueError(f"controller.models names repeat: {names}")

    @classmethod
    def from_dict(cls, raw: dict) -> "ControllerConfig":
        """Validate a parsed TOML/JSON table; errors name the offending field."""
        return msgspec.convert(raw, cls)

    def limits(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per-pool minimum and maximum worker counts."""
        lo: dict[str, int] = {}
        hi: dict[str, int] = {}
        for m in self.models:
            lo[pool_key("generator", m.name)], hi[pool_key("generator", m.name)] = m.min_generators, m.max_generators
            lo[pool_key("learner", m.name)], hi[pool_key("learner", m.name)] = m.min_learners, m.max_learners
        return lo, hi

    def group_size(self, model: str) -> int:
        return next(m.group_size for m in self.models if m.name == model)


class PoolView(msgspec.Struct, kw_only=True):
    """What the Stats since the previous call say about one (role, model) pool."""

    key: str  # "generator:<model>" or "learner:<model>"
    workers: list[str]  # assigned to this pool now (in transition or not)
    reporting: int = 0  # workers with usable Stats in this view
    done: float = 0.0  # samples generated (generator) or consumed (learner) in their windows
    busy_s: float = 0.0  # sum over reporting workers of window_s * (1 - idle_frac)
    window_s: float = 0.0
    queue_depth: int = 0  # learner: largest reported queue (samples)
    peer_wait_s: float = 0.0
    staleness_mean: float = 0.0


class ClusterView(msgspec.Struct, kw_only=True):
    """The controller's whole input besides its own state and config."""

    time: float
    assignment: dict[str, tuple[str, str]]  # worker_id -> (role, model), as last assigned
    pools: dict[str, PoolView]
    # each learner group's rank 0: it keeps its role (the group's state is its), so it is never moved itself; a move
    # planned for it would become a move of another member, whose dwell time would not have been asked
    leaders: list[str] = []


class ControllerState(msgspec.Struct, kw_only=True):
    """What the controller remembers between calls; JSON-serialisable."""

    capacity: dict[str, float] = {}  # pool -> samples/s of one busy worker (EWMA)
    capacity_at: dict[str, float] = {}  # pool -> time of the last estimate update
    pending: dict[str, tuple[float, float, float]] = {}  # pool -> (done, busy_s, since): evidence short of min_busy_s
    moved_at: dict[str, float] = {}  # worker -> time it was last reassigned
    last_decision_at: float = -math.inf
    last_move_at: float = -math.inf
    epoch: int = 0


class Decision(msgspec.Struct, kw_only=True):
    """The controller's answer: who moves, why, and the state to pass next time."""

    time: float
    epoch: int
    acted: bool
    assignments: dict[str, tuple[str, str]]  # only the workers that change: worker_id -> (role, model)
    reasons: list[str]
    counts_before: dict[str, int]
    counts_after: dict[str, int]
    prompts_per_s_worker: dict[str, float]  # capacity estimates in prompt groups/s per worker
    predicted_before: float  # slowest pool's prompt rate, current split (nan if unknown)
    predicted_after: float
    new_state: ControllerState

    def to_record(self) -> dict:
        """One metrics.jsonl line (plain JSON types)."""
        rec = msgspec.to_builtins(self)
        del rec["new_state"]
        rec["kind"] = "mwra_decision"
        rec["assignments"] = {w: list(rm) for w, rm in self.assignments.items()}
        for k in ("predicted_before", "predicted_after"):
            if not math.isfinite(rec[k]):
                rec[k] = None
        return rec

    def to_assign_messages(self) -> list[Assign]:
        reason = "; ".join(self.reasons)
        return [Assign(schema=SCHEMA_VERSION, epoch=self.epoch, worker_id=w, role=role, model=model, reason=reason)
                for w, (role, model) in sorted(self.assignments.items())]


def view_from_stats(stats: list[Stats], assignment: dict[str, tuple[str, str]], now: float,
                    config: ControllerConfig, leaders: list[str] | None = None) -> ClusterView:
    """Aggregate the Stats that arrived since the previous call into pools.

    Pass each Stats once: every window is new evidence, and a window counted again would
    keep an old speed alive after the workload drifted (an idle generator sends nothing,
    so its last report would otherwise speak for it long after its cost changed). Stats
    from a worker whose reported (role, model) differs from its assignment are ignored:
    it is still switching. So are Stats older than ``stale_stats_s`` and those of workers
    not in ``assignment`` (brokers, departed workers).
    """
    pools = {pool_key(r, m.name): PoolView(key=pool_key(r, m.name), workers=[])
             for m in config.models for r in ("generator", "learner")}
    for worker, (role, model) in sorted(assignment.items()):
        key = pool_key(role, model)
        if key in pools:
            pools[key].workers.append(worker)
    reporters: dict[str, set[str]] = {k: set() for k in pools}
    for s in sorted(stats, key=lambda s: s.time):
        key = pool_key(s.role, s.model)
        if (s.worker_id not in assignment or assignment[s.worker_id] != (s.role, s.model) or key not in pools
                or now - s.time > config.stale_stats_s):
            continue
        p = pools[key]
        idle = min(max(s.idle_frac, 0.0), 1.0)
        rate = s.samples_per_s if s.role == "generator" else s.consumed_per_s
        reporters[key].add(s.worker_id)
        p.done += rate * s.window_s
        p.busy_s += s.window_s * (1.0 - idle)
        p.window_s += s.window_s
        p.queue_depth = max(p.queue_depth, s.queue_depth)
        p.peer_wait_s += s.peer_wait_s
        p.staleness_mean += s.staleness_mean * s.window_s
    for key, p in pools.items():
        p.reporting = len(reporters[key])
        if p.window_s > 0:
            p.staleness_mean /= p.window_s
    return ClusterView(time=now, assignment=dict(assignment), pools=pools, leaders=sorted(leaders or []))


def initial_assignment(worker_ids: list[str], config: ControllerConfig) -> dict[str, tuple[str, str]]:
    """A first split with no stats: every pool gets its minimum, the rest go round-robin."""
    lo, hi = config.limits()
    keys = sorted(lo)
    counts = max_min_counts({k: 1.0 for k in keys}, len(worker_ids), lo, hi)
    out: dict[str, tuple[str, str]] = {}
    it = iter(sorted(worker_ids))
    for k in keys:
        for _ in range(counts[k]):
            out[next(it)] = split_key(k)
    for w in it:
        out[w] = ("idle", "")
    return out


def _update_capacity(view: ClusterView, state: ControllerState, config: ControllerConfig) -> ControllerState:
    """Fold each pool's new windows into its estimate once they add up to ``min_busy_s`` of busy time.

    A pool that is seldom busy (a cheap model's learners, ~10% of the time) shows little busy
    time per call; its evidence is kept across calls (``pending``) until there is enough, or
    dropped once it is older than ``stale_stats_s``, so it still speaks within a few calls.
    """
    capacity, capacity_at, pending = dict(state.capacity), dict(state.capacity_at), dict(state.pending)
    for key, p in view.pools.items():
        done, busy_s, since = pending.pop(key, (0.0, 0.0, view.time))
        if view.time - since > config.stale_stats_s:
            done, busy_s, since = 0.0, 0.0, view.time
        done, busy_s = done + p.done, busy_s + p.busy_s
        if busy_s < config.min_busy_s or busy_s <= 0:
            if busy_s > 0:
                pending[key] = (done, busy_s, since)
            continue
        sample = done / busy_s
        if key not in capacity:
            capacity[key] = sample
        else:
            dt = max(view.time - capacity_at.get(key, view.time), 0.0)
            alpha = 1.0 - 0.5 ** (dt / config.ewma_halflife_s)
            capacity[key] += alpha * (sample - capacity[key])
        capacity_at[key] = view.time
    return msgspec.structs.replace(state, capacity=capacity, capacity_at=capacity_at, pending=pending)


def _counts(assignment: dict[str, tuple[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for role, model in assignment.values():
        key = IDLE_POOL if role == "idle" else pool_key(role, model)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _demand(view: ClusterView, prompt_cap: dict[str, float], config: ControllerConfig) -> tuple[dict, list[str]]:
    """Extra prompts/s a flooded learner pool needs to drain its backlog; starved pools, named."""
    demand: dict[str, float] = {}
    notes: list[str] = []
    for key, p in view.pools.items():
        role, model = split_key(key)
        if role != "learner" or key not in prompt_cap:
            continue
        queued = p.queue_depth / config.group_size(model)
        keeps_up = len(p.workers) * prompt_cap[key] * config.flood_queue_s
        if queued > keeps_up:
            demand[key] = (queued - keeps_up) / config.drain_horizon_s
            notes.append(f"{key} flooded: {queued:.0f} prompts queued > {keeps_up:.0f} ({config.flood_queue_s:.0f}s of work)")
        elif p.window_s > 0 and p.busy_s / p.window_s < 0.5:
            notes.append(f"{key} starved: busy {p.busy_s / p.window_s:.0%} of its window")
    return demand, notes


def _pick_workers(view: ClusterView, state: ControllerState, moves: list[tuple[str, str]],
                  movable: dict[str, list[str]]) -> dict[str, tuple[str, str]]:
    """Concrete workers for pool-level moves: same model preferred (cheaper switch), then longest dwell."""
    out: dict[str, tuple[str, str]] = {}
    for frm, to in moves:
        to_model = split_key(to)[1]
        cands = movable[frm]
        cands.sort(key=lambda w: (view.assignment[w][1] != to_model, state.moved_at.get(w, -math.inf), w))
        worker = cands.pop(0)
        out[worker] = split_key(to)
    return out


def _no_op(view, state, config, counts, prompt_cap, before, reasons) -> Decision:
    return Decision(time=view.time, epoch=state.epoch, acted=False, assignments={}, reasons=reasons,
                    counts_before=counts, counts_after=counts, prompts_per_s_worker=prompt_cap,
                    predicted_before=before, predicted_after=before, new_state=state)


def decide(view: ClusterView, state: ControllerState, config: ControllerConfig) -> Decision:
    """The MWRA policy: one pure step from (view, state, config) to a Decision."""
    state = _update_capacity(view, state, config)
    capacity = state.capacity
    counts = _counts(view.assignment)
    lo, hi = config.limits()
    pools = sorted(lo)
    prompt_cap = {k: capacity[k] / config.group_size(split_key(k)[1]) for k in pools if k in capacity}
    pool_counts = {k: counts.get(k, 0) for k in pools}
    violations = [k for k in pools if not lo[k] <= pool_counts[k] <= hi[k]]
    known = len(prompt_cap) == len(pools)
    before = bottleneck_rate(pool_counts, prompt_cap) if known else math.nan
    args = (view, state, config, counts, prompt_cap, before)

    if view.time - state.last_decision_at < config.decision_interval_s and not violations:
        return _no_op(*args, ["not yet: decision interval"])
    state = msgspec.structs.replace(state, last_decision_at=view.time)
    args = (view, state, config, counts, prompt_cap, before)
    if view.time - state.last_move_at < config.cooldown_s and not violations:
        return _no_op(*args, ["cooling down after the last move"])
    if not known and not violations:
        missing = [k for k in pools if k not in prompt_cap]
        return _no_op(*args, [f"waiting for busy time in {', '.join(missing)}"])

    # Pools without an estimate (only possible with violations) are valued as fast, so
    # they get exactly their minimum and never pull workers they cannot be shown to need.
    cap_for_plan = {k: prompt_cap.get(k, math.inf) for k in pools}
    demand, notes = _demand(view, prompt_cap, config)
    target = max_min_counts(cap_for_plan, len(view.assignment), lo, hi, demand)
    after_target = bottleneck_rate(target, prompt_cap, demand) if known else math.nan
    now_rate = bottleneck_rate(pool_counts, prompt_cap, demand) if known else math.nan
    gain = after_target / now_rate - 1.0 if known and now_rate > 0 else math.inf
    if not violations and gain < config.improvement_threshold:
        return _no_op(*args, notes + [f"balanced: best split gains {gain:+.1%} < {config.improvement_threshold:.0%}"])

    movable: dict[str, list[str]] = {}
    for w, (role, model) in view.assignment.items():
        if w in view.leaders:
            continue
        if view.time - state.moved_at.get(w, -math.inf) >= config.min_dwell_s or role == "idle":
            key = IDLE_POOL if role == "idle" else pool_key(role, model)
            movable.setdefault(key, []).append(w)
    max_moves = max(1, int(config.max_move_frac * len(view.assignment)))
    moves = plan_moves(counts, target, cap_for_plan, {k: len(v) for k, v in movable.items()}, max_moves, demand)
    after_counts = dict(counts)
    for frm, to in moves:
        after_counts[frm] -= 1
        after_counts[to] = after_counts.get(to, 0) + 1
    after_pools = {k: after_counts.get(k, 0) for k in pools}
    after = bottleneck_rate(after_pools, prompt_cap) if known else math.nan
    if not moves or (known and not violations and bottleneck_rate(after_pools, prompt_cap, demand) <= now_rate):
        return _no_op(*args, notes + ["no allowed move speeds up the slowest pool (dwell, move budget)"])

    assignments = _pick_workers(view, state, moves, movable)
    moved_at = dict(state.moved_at)
    moved_at.update({w: view.time for w in assignments})
    summary = ", ".join(f"{frm}->{to}" for frm, to in moves)
    why = (f"restore limits of {', '.join(violations)}" if violations
           else f"slowest pool {min(pools, key=lambda k: pool_rate(pool_counts[k], prompt_cap[k]))} "
                f"limits the run: predicted {before:.3g} -> {after:.3g} prompts/s")
    new_state = msgspec.structs.replace(state, moved_at=moved_at, last_decision_at=view.time,
                                        last_move_at=view.time, epoch=state.epoch + 1)
    return Decision(time=view.time, epoch=new_state.epoch, acted=True, assignments=assignments,
                    reasons=notes + [why, f"moves: {summary}"], counts_before=counts, counts_after=after_counts,
                    prompts_per_s_worker=prompt_cap, predicted_before=before, predicted_after=after,
                    new_state=new_state)
