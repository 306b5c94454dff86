"""Work dispatch: each learner step's prompts, split into work units that generators pull.

Step k's prompts are the same global prompt ids for every model (so cross-model groups
line up) and go out in units of ``pool.prompts_per_work`` prompts (0: the whole step).
A generator asks for work (``WantWork``); a new step's units are issued to model m only
while m is

- fewer than ``train.max_inflight_steps`` steps ahead of its own learner, and fewer than
  ``train.max_model_lead_steps`` ahead of the slowest live peer's learner (a fast model
  cannot run away from its peers);
- in sync mode (``run.mode = "sync"``), not ahead at all: step k is issued once the learner
  has taken k steps, and its units ask for weight version k. That is the whole
  synchronous baseline: a dispatch rule, not a second engine.

Every unit sent is remembered until its generator reports it done, so a unit never waits
on a worker that has gone: a generator that leaves hands back what it has not started,
and the units of one that dies are taken back. Either way they go to the front of the queue.
"""

from __future__ import annotations

import collections

from engine.config import RunConfig
from engine.runtime.plane import WorkUnit
from tasks.base import Problem


class Dispatch:
    def __init__(self, cfg: RunConfig, task):
        self.names, self.task = cfg.names, task
        t = cfg.train
        self.Q, self.G, self.total_steps = t.prompts_per_step, t.group_size, t.steps
        self.per_unit = cfg.pool.prompts_per_work or t.prompts_per_step
        self.max_inflight, self.max_lead = t.max_inflight_steps, t.max_model_lead_steps
        self.sync = cfg.run.mode == "sync"
        self.pending = {m: collections.deque() for m in self.names}  # generators waiting for work
        self.ready = {m: collections.deque() for m in self.names}  # units nobody holds
        self.issued = {m: 0 for m in self.names}  # steps issued per model
        self.steps = {m: 0 for m in self.names}  # steps its learner took
        self.out: set[str] = set()  # models out of the run, or finished: no work, no lead limit
        self.silent: set[str] = set()  # models presumed gone (no learner step for a while): no lead limit
        self.held: dict[str, list[WorkUnit]] = {}  # worker -> units sent to it and not yet done
        self.done_prompts: dict[str, list[int]] = {m: [] for m in self.names}  # generated, per UnitDone
        self.retaken: dict[str, set[int]] = {m: set() for m in self.names}  # prompts re-issued after a death
        self.handbacks = 0

    def problems(self, step: int) -> list[Problem]:
        return [self.task.problem(i) for i in range(step * self.Q, (step + 1) * self.Q)]

    # --- what the coordinator hears ---
    def want(self, worker: str, model: str) -> None:
        if worker not in self.pending[model]:
            self.pending[model].append(worker)

    def handed_back(self, worker: str, unit: WorkUnit) -> None:
        self._drop_held(worker, unit)
        self.ready[unit.model].appendleft(unit)
        self.handbacks += 1

    def done(self, worker: str, model: str, prompt_ids: list[int]) -> None:
        for unit in self.held.get(worker, []):
            if unit.model == model and unit.prompt_ids == prompt_ids:
                self._drop_held(worker, unit)
                break
        self.done_prompts[model].extend(prompt_ids)

    def stepped(self, model: str, step: int) -> None:
        self.steps[model] = max(self.steps[model], step)

    def leave(self, model: str) -> None:
        """``model`` gets no more work and holds nobody back (it finished or left the run)."""
        self.out.add(model)
        self.ready[model].clear()

    def reassigned(self, worker: str) -> None:
        """A worker given a new role waits for no work of its old one."""
        for q in self.pending.values():
            if worker in q:
                q.remove(worker)

    def lost(self, worker: str) -> list[WorkUnit]:
        """A generator died: it waits for nothing, and every unit it held goes back to the front."""
        self.reassigned(worker)
        units = self.held.pop(worker, [])
        for unit in reversed(units):
            self.ready[unit.model].appendleft(unit)
            self.retaken[unit.model].update(unit.prompt_ids)
        return units

    def regenerate(self, model: str, prompt_ids: list[int]) -> None:
        """Generate these prompts of ``model`` again (its learner's inbox died with it), in their own units."""
        by_step: dict[int, list[int]] = {}
        for p in sorted(set(prompt_ids)):
            by_step.setdefault(p // self.Q, []).append(p)
        for step, ids in sorted(by_step.items(), reverse=True):
            problems = [self.task.problem(i) for i in ids]
            self.ready[model].appendleft(WorkUnit(model, step, self.G, problems, step if self.sync else 0))
            self.retaken[model].update(ids)

    def resume(self, m: str, step: int, consumed: set[int], logged: dict[int, int]) -> list[int]:
        """Continue model m after its learner's ``step`` (``engine.schedule.resume``): returns the prompts
        handed out again, those neither trained (``consumed``) nor complete in the log (``logged``: samples)."""
        self.steps[m] = step
        seen = consumed | logged.keys()
        self.issued[m] = max([step, *(p // self.Q + 1 for p in seen)])
        owed = [p for p in range(self.issued[m] * self.Q) if p not in consumed and logged.get(p, 0) < self.G]
        self.regenerate(m, owed)
        return owed

    # --- what the coordinator sends ---
    def may_issue(self, m: str) -> bool:
        if m in self.out or self.issued[m] >= self.total_steps:
            return False
        ahead = self.issued[m] - self.steps[m]
        if ahead >= (1 if self.sync else self.max_inflight):
            return False
        peers = [self.steps[n] for n in self.names if n != m and n not in self.out | self.silent]
        return not peers or self.issued[m] - min(peers) < self.max_lead

    def next_work(self, m: str) -> list[tuple[str, WorkUnit]]:
        """(generator, unit) pairs to send now: waiting generators get held-back units first, then new steps."""
        out = []
        while self.pending[m] and (self.ready[m] or self.may_issue(m)):
            if not self.ready[m]:
                self.ready[m].extend(self._units(m, self.issued[m]))
                self.issued[m] += 1
            worker, unit = self.pending[m].popleft(), self.ready[m].popleft()
            self.held.setdefault(worker, []).append(unit)
            out.append((worker, unit))
        return out

    def _units(self, m: str, step: int) -> list[WorkUnit]:
        """Step ``step`` of model m in units: small units spread a step over every generator of the pool."""
        problems, n = self.problems(step), self.per_unit
        return [WorkUnit(m, step, self.G, problems[i:i + n], step if self.sync else 0)
                for i in range(0, len(problems), n)]

    def _drop_held(self, worker: str, unit: WorkUnit) -> None:
        units = self.held.get(worker, [])
        if unit in units:
            units.remove(unit)
