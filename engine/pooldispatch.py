"""Prompt dispatch for pool mode: step batches split into work units that generators pull.

Every prompt batch k holds the same global prompt ids for every model, and is handed
out in work units of ``prompts_per_work`` prompts. A generator asks for work
(``WantWork``); a new batch is issued to model m only while m is at most
``max_inflight_batches`` ahead of its own learner and ``max_model_lead_batches`` ahead
of the slowest live peer's learner (a fast model cannot run away from its peers).

Every unit sent is remembered until its generator reports it done, so a unit never
waits on a worker that has gone: a generator that leaves hands back what it has not
started, and the units of one that dies are taken back here. Either way they go to the
front of the queue.
"""

from __future__ import annotations

import collections
import time

from engine.plan import PromptBook
from engine.poolconfig import PoolConfig
from exchange.protocol import SCHEMA_VERSION, PromptBatch


class Dispatch:
    def __init__(self, names: list[str], prompts: PromptBook, pool: PoolConfig, run_id: str, group_size: int):
        self.names, self.prompts, self.pool = names, prompts, pool
        self.run_id, self.G = run_id, group_size
        self.pending = {m: collections.deque() for m in names}  # generators waiting for work
        self.ready = {m: collections.deque() for m in names}  # units of issued batches that nobody holds
        self.issued = {m: 0 for m in names}  # batches issued per model
        self.steps = {m: 0 for m in names}
        self.stepped_at = {m: time.time() for m in names}  # when each model's learner last stepped
        self.held: dict[str, list[PromptBatch]] = {}  # worker -> units sent to it and not yet done
        self.done_prompts: dict[str, list[int]] = {m: [] for m in names}  # generated, per BatchDone
        self.retaken: dict[str, set[int]] = {m: set() for m in names}  # prompts of units taken from the dead
        self.handbacks = 0

    def start_clock(self, now: float) -> None:
        self.stepped_at = {m: now for m in self.names}

    # --- what the coordinator hears ---
    def want(self, worker: str, model: str) -> None:
        if worker not in self.pending[model]:
            self.pending[model].append(worker)

    def handed_back(self, worker: str, unit: PromptBatch) -> None:
        self._drop_held(worker, unit.problems[0].prompt_id)
        self.ready[unit.model].appendleft(unit)
        self.handbacks += 1

    def done(self, worker: str, model: str, prompt_ids: list[int]) -> None:
        if prompt_ids:
            self._drop_held(worker, prompt_ids[0])
        self.done_prompts[model].extend(prompt_ids)

    def stepped(self, model: str, step: int, now: float) -> None:
        self.steps[model] = step
        self.stepped_at[model] = now

    def reassigned(self, worker: str) -> None:
        """A worker given a new role waits for no work of its old one."""
        for q in self.pending.values():
            if worker in q:
                q.remove(worker)

    def lost(self, worker: str) -> list[PromptBatch]:
        """A generator died: it waits for nothing, and every unit it held goes back to the front."""
        self.reassigned(worker)
        units = self.held.pop(worker, [])
        for unit in reversed(units):
            self.ready[unit.model].appendleft(unit)
            self.retaken[unit.model].update(p.prompt_id for p in unit.problems)
        return units

    # --- what the coordinator sends ---
    def may_issue(self, m: str, now: float) -> bool:
        """Within the model's lead over its own learner, and over the slowest live *peer's* learner.

        The second limit keeps a fast model from running away from its peers; it is not
        applied against the model itself (as the slowest, it would cap its own pipeline at
        ``max_model_lead_batches`` instead of ``max_inflight_batches`` and idle its generators
        while its learner catches up). A peer whose learner has not stepped for
        ``peer_dead_after_s`` is presumed dead (its peers train solo then, see
        engine.poollearner.PeerWatch), so it holds nobody back.
        """
        if self.issued[m] - self.steps[m] >= self.pool.max_inflight_batches:
            return False
        peers = [self.steps[n] for n in self.names
                 if n != m and now - self.stepped_at[n] <= self.pool.peer_dead_after_s]
        return not peers or self.issued[m] - min(peers) < self.pool.max_model_lead_batches

    def next_work(self, m: str, now: float) -> list[tuple[str, PromptBatch]]:
        """(generator, unit) pairs to send now: waiting generators get held units first, then new batches."""
        out = []
        while self.pending[m] and (self.ready[m] or self.may_issue(m, now)):
            if not self.ready[m]:
                self.ready[m].extend(self._work_units(m, self.issued[m]))
                self.issued[m] += 1
            worker, unit = self.pending[m].popleft(), self.ready[m].popleft()
            self.held.setdefault(worker, []).append(unit)
            out.append((worker, unit))
        return out

    def _work_units(self, m: str, k: int) -> list[PromptBatch]:
        """Batch k of model m split into units of ``prompts_per_work`` prompts.

        Small units spread one learner step over every generator of the pool (a step's
        prompts finish together instead of one generator holding them all), and each
        unit's Stats reach the controller a whole batch sooner after a cost change.
        """
        problems, n = self.prompts.batch(k), self.pool.prompts_per_work
        return [PromptBatch(schema=SCHEMA_VERSION, run_id=self.run_id, batch_id=k, model=m, group_size=self.G,
                            problems=problems[i:i + n])
                for i in range(0, len(problems), n)]

    def _drop_held(self, worker: str, first_prompt: int) -> None:
        units = self.held.get(worker, [])
        for i, unit in enumerate(units):
            if unit.problems[0].prompt_id == first_prompt:
                del units[i]
                return
