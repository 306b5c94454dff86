"""Who does what: the allocator decides every worker's role, at the start and while the run goes.

- ``static``: the split the config writes (``pool.split``; by default one learner per model
  and the other workers generating, round robin over the models); the controller is off.
- ``mwra``: the MWRA controller (``engine.schedule.controller.decide``) reads the workers'
  Stats and moves workers between pools.
- ``Script``: forced moves on top of either, each triggered by an event (a model's
  learner reaching a step), for tests and demos.

Who does what is kept in the run directory (``allocation.json``, rewritten when it changes): a
resumed run (``launch.py resume``) starts from the split the stopped run had reached, with MWRA's
estimates and the scripted moves already made, instead of from the config's first split.

Workers take the split's roles in pool-key order: with ``generator:gpt2 = 2``, w0 and w1
generate for gpt2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from engine.config import RunConfig, ScriptedMove
from engine.schedule.allocation import ROLES
from engine.schedule.controller import (ControllerConfig, ControllerState, ModelLimits, decide, initial_assignment,
                                        view_from_stats)
from exchange.protocol import Stats

RoleOf = tuple[str, str]  # (role, model); model "" for idle


def controller_config(cfg: RunConfig) -> ControllerConfig:
    """MWRA settings: per-model limits from the run, time constants scaled for a CPU box, ``pool.controller`` on top."""
    limits = [ModelLimits(name=m, group_size=cfg.train.group_size, max_learners=cfg.train.prompts_per_step)
              for m in cfg.names]
    cpu_scale = {"decision_interval_s": 5.0, "cooldown_s": 10.0, "min_dwell_s": 15.0, "ewma_halflife_s": 8.0,
                 "min_busy_s": 2.0, "flood_queue_s": 30.0, "drain_horizon_s": 30.0, "stale_stats_s": 20.0}
    try:
        return msgspec.convert({**cpu_scale, **cfg.pool.controller, "models": msgspec.to_builtins(limits)},
                               ControllerConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc).replace("`", "")) from None


def static_split(cfg: RunConfig) -> dict[str, int]:
    """``pool.split``, or: one learner per model, the remaining workers generate (round robin over the models)."""
    if cfg.pool.split:
        return dict(cfg.pool.split)
    split = {f"learner:{m}": 1 for m in cfg.names}
    for i in range(cfg.pool.workers - len(cfg.names)):
        key = f"generator:{cfg.names[i % len(cfg.names)]}"
        split[key] = split.get(key, 0) + 1
    return split


class Allocator:
    """The static allocator; ``MWRAAllocator`` overrides ``first_split`` and ``tick``. Either keeps who does what
    in ``allocation.json`` (``keep``) and, in a resumed run, starts from the stopped run's (``recall``)."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.script = Script(cfg.pool.script)
        self.recalled: dict[str, RoleOf] = {}
        self._kept: dict | None = None

    def initial(self, workers: list[str]) -> dict[str, RoleOf]:
        """The first split: the stopped run's, when recalled; else the allocator's own."""
        return dict(self.recalled) if self.recalled else self.first_split(workers)

    def first_split(self, workers: list[str]) -> dict[str, RoleOf]:
        split = static_split(self.cfg)
        it = iter(workers)
        return {next(it): tuple(key.split(":", 1)) for key in sorted(split) for _ in range(split[key])}

    def tick(self, now: float, stats: list[Stats], assignment: dict[str, RoleOf], leaders: list[str] | None = None
             ) -> tuple[dict[str, RoleOf], str, list[dict]]:
        """Moves to make now: (worker -> new role, why, metrics records); ``leaders``: each learner group's rank 0."""
        return {}, "", []

    def freeze(self, why: str) -> None:
        """Make no more moves (a model left the run: the pools no longer match the config)."""

    def last_moves(self) -> dict[str, float]:
        """Worker -> when it last changed role, as far as this allocator keeps track (for the choice of a stand-in)."""
        return {}

    def memory(self) -> dict:
        """What a resumed run needs of this allocator besides the assignment (JSON)."""
        return {}

    def recall_memory(self, memory: dict) -> None:
        """Take back ``memory()`` of the stopped run."""

    def keep(self, assignment: dict[str, RoleOf]) -> None:
        """``allocation.json``, rewritten when the split, the memory or the scripted moves made changed."""
        data = {"assignment": {w: list(rm) for w, rm in sorted(assignment.items())},
                "script_fired": list(self.script.fired), "memory": self.memory()}
        if data != self._kept and self.run_dir is not None:
            save_allocation(self.run_dir, data)
            self._kept = data

    def recall(self) -> str:
        """A resumed run: take back the stopped run's allocation if it fits this one; the line that says which."""
        workers = [f"w{i}" for i in range(self.cfg.pool.workers)]
        saved, said = load_allocation(self.run_dir, workers, self.cfg.names)
        if saved is not None:
            self.recalled, self.script.fired = dict(saved.assignment), list(saved.script_fired)
            self.recall_memory(saved.memory)
        return said


class MWRAAllocator(Allocator):
    def __init__(self, cfg: RunConfig, run_dir: Path | None = None):
        super().__init__(cfg, run_dir)
        self.ccfg = controller_config(cfg)
        self.state = ControllerState()
        self.frozen = ""
        self._last_reasons: list[str] = []

    def first_split(self, workers: list[str]) -> dict[str, RoleOf]:
        return initial_assignment(workers, self.ccfg)

    def tick(self, now, stats, assignment, leaders=None):
        if self.frozen:
            return {}, "", []
        decision = decide(view_from_stats(stats, assignment, now, self.ccfg, leaders), self.state, self.ccfg)
        self.state = decision.new_state
        records = []
        if decision.acted or decision.reasons != self._last_reasons:  # a no-op is logged when its reasons change
            records.append(decision.to_record())
        self._last_reasons = decision.reasons
        return (dict(decision.assignments), "; ".join(decision.reasons), records) if decision.acted else ({}, "", records)

    def last_moves(self) -> dict[str, float]:
        return self.state.moved_at

    def moved(self, worker: str, now: float) -> None:
        """A worker was moved by someone else (a leader's stand-in): its dwell time starts now."""
        self.state.moved_at[worker] = now

    def freeze(self, why: str) -> None:
        self.frozen = why

    def memory(self) -> dict:
        return {"controller": msgspec.to_builtins(self.state)}

    def recall_memory(self, memory: dict) -> None:
        """The estimates, dwell times and cooldown go on (all on the wall clock): an estimate older than the
        resume weighs little against the first new evidence (``ewma_halflife_s``)."""
        if memory.get("controller") is not None:
            self.state = msgspec.convert(memory["controller"], ControllerState)


def make_allocator(cfg: RunConfig, run_dir: Path | None = None) -> Allocator:
    """``run_dir``: where ``allocation.json`` is kept (None: not kept)."""
    return MWRAAllocator(cfg, run_dir) if cfg.pool.allocator == "mwra" else Allocator(cfg, run_dir)


class Script:
    """Scripted moves, each due once its trigger model's learner has reached ``at_step``."""

    def __init__(self, moves: list[ScriptedMove]):
        self.moves = list(moves)
        self.fired: list[int] = []  # indices into ``moves``, in the order they fired

    def due(self, steps: dict[str, int]) -> list[ScriptedMove]:
        ready = [i for i, m in enumerate(self.moves) if i not in self.fired and steps.get(m.step_of, 0) >= m.at_step]
        self.fired += ready
        return [self.moves[i] for i in ready]


ALLOCATION = "allocation.json"


class SavedAllocation(msgspec.Struct, forbid_unknown_fields=True):
    assignment: dict[str, RoleOf]
    script_fired: list[int] = []
    memory: dict = {}


def save_allocation(run_dir: Path, data: dict) -> None:
    """``allocation.json``, replaced whole (a kill mid-write leaves the previous one)."""
    tmp = run_dir / f"{ALLOCATION}.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n")  # json, not msgspec: the controller's times may be -inf
    os.replace(tmp, run_dir / ALLOCATION)


def load_allocation(run_dir: Path, workers: list[str], models: list[str]) -> tuple[SavedAllocation | None, str]:
    """The stopped run's allocation if it fits this run (the same workers; every model has a generator and a
    learner), else None; and a line saying which."""
    path = run_dir / ALLOCATION
    if not path.is_file():
        return None, "no saved allocation: workers start from the config's split"
    try:
        saved = msgspec.convert(json.loads(path.read_text()), SavedAllocation)
    except (OSError, ValueError, msgspec.ValidationError) as exc:
        return None, f"{path}: unreadable ({exc}); workers start from the config's split"
    unfit = _unfit(saved.assignment, workers, models)
    if unfit:
        return None, f"the saved allocation does not fit this run ({unfit}); workers start from the config's split"
    roles = ", ".join(f"{w} {r}:{m}" if m else f"{w} {r}" for w, (r, m) in sorted(saved.assignment.items()))
    return saved, f"workers take the roles they had when the run stopped: {roles}"


def _unfit(assignment: dict[str, RoleOf], workers: list[str], models: list[str]) -> str:
    if sorted(assignment) != sorted(workers):
        return f"it names workers {sorted(assignment)}, this run has {sorted(workers)}"
    for w, (role, model) in sorted(assignment.items()):
        if (role, model) != ("idle", "") and (role not in ROLES or model not in models):
            return f"{w} has the role {role}:{model}"
    for m in models:
        for role in ROLES:
            if (role, m) not in assignment.values():
                return f"{m} has no {role}"
    return ""
