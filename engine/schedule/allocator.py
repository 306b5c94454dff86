"""Who does what: the allocator decides every worker's role, at the start and while the run goes.

- ``static``: the split the config writes (``pool.split``; by default one learner per model
  and the other workers generating, round robin over the models); the controller is off.
- ``mwra``: the MWRA controller (``engine.schedule.controller.decide``) reads the workers'
  Stats and moves workers between pools.
- ``Script``: forced moves on top of either, each triggered by an event (a model's
  learner reaching a step), for tests and demos.

Workers take the split's roles in pool-key order: with ``generator:gpt2 = 2``, w0 and w1
generate for gpt2.
"""

from __future__ import annotations

import msgspec

from engine.config import RunConfig, ScriptedMove
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
    """The static allocator; ``MWRAAllocator`` overrides ``initial`` and ``tick``."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def initial(self, workers: list[str]) -> dict[str, RoleOf]:
        split = static_split(self.cfg)
        it = iter(workers)
        return {next(it): tuple(key.split(":", 1)) for key in sorted(split) for _ in range(split[key])}

    def tick(self, now: float, stats: list[Stats], assignment: dict[str, RoleOf]) -> tuple[dict[str, RoleOf], str,
                                                                                            list[dict]]:
        """Moves to make now: (worker -> new role, why, metrics records)."""
        return {}, "", []

    def freeze(self, why: str) -> None:
        """Make no more moves (a model left the run: the pools no longer match the config)."""

    def last_moves(self) -> dict[str, float]:
        """Worker -> when it last changed role, as far as this allocator keeps track (for the choice of a stand-in)."""
        return {}


class MWRAAllocator(Allocator):
    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.ccfg = controller_config(cfg)
        self.state = ControllerState()
        self.frozen = ""
        self._last_reasons: list[str] = []

    def initial(self, workers: list[str]) -> dict[str, RoleOf]:
        return initial_assignment(workers, self.ccfg)

    def tick(self, now, stats, assignment):
        if self.frozen:
            return {}, "", []
        decision = decide(view_from_stats(stats, assignment, now, self.ccfg), self.state, self.ccfg)
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


def make_allocator(cfg: RunConfig) -> Allocator:
    return MWRAAllocator(cfg) if cfg.pool.allocator == "mwra" else Allocator(cfg)


class Script:
    """Scripted moves, each due once its trigger model's learner has reached ``at_step``."""

    def __init__(self, moves: list[ScriptedMove]):
        self.waiting = list(moves)

    def due(self, steps: dict[str, int]) -> list[ScriptedMove]:
        ready = [m for m in self.waiting if steps.get(m.step_of, 0) >= m.at_step]
        self.waiting = [m for m in self.waiting if m not in ready]
        return ready
