"""A learner rank in pool mode (see ``engine.dataparallel`` for the group protocol).

The leader (rank 0) keeps the model's inbox (``engine.ingest.Ingest``) for the whole
run: the coordinator never moves a group's leader while the group exists (it moves
another member of the same pool instead), so no buffered experience changes hands.
Followers only see what the leader broadcasts.

No deadlock, no starvation:
- waiting for peers' groups on a step's prompts lasts at most ``train.peer_deadline_s``;
  then the step uses what arrived and counts the misses (as the engine's learner does);
- a peer model silent for ``pool.peer_dead_after_s`` is declared dead: the learner
  stops waiting for it, trains solo, and says so in metrics.jsonl and on stderr;
- while the leader waits for data it sends ``TICK`` headers, so followers blocked in
  a collective never hit the gloo time-out.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from engine import dataparallel as dp
from engine.batching import PeerSample, batch_to, build_batch, model_device
from engine.config import tokenizer_cache
from engine.ingest import Ingest
from engine.metrics import MetricsWriter
from engine.optim import adamw
from engine.poolplane import GroupFormed, GroupSpec, LearnerFinal, StepDone
from engine.poolworker import WeightStore, Worker
from exchange.protocol import SCHEMA_VERSION, Experience, Stats, WeightsReady
from exchange.transport import Subscriber
from policies.objectives import compute_loss
from tokenbridge import load_tokenizer


class PeerWatch:
    """Which peers count as alive: a peer silent for ``dead_after_s`` is dead until it speaks again."""

    def __init__(self, peers: list[str], dead_after_s: float, now: float):
        self.dead_after_s = dead_after_s
        self.last_seen = {p: now for p in peers}
        self.dead: set[str] = set()

    def heard(self, peer: str, now: float) -> None:
        self.last_seen[peer] = now

    def update(self, now: float) -> list[str]:
        """Re-evaluate; returns one sentence per change (for the terminal and metrics)."""
        notes = []
        for peer, seen in self.last_seen.items():
            silent = now - seen > self.dead_after_s
            if silent and peer not in self.dead:
                self.dead.add(peer)
                notes.append(f"no experience from peer {peer} for {now - seen:.0f}s: it is presumed dead, training solo")
            elif not silent and peer in self.dead:
                self.dead.discard(peer)
                notes.append(f"peer {peer} is back: waiting for its groups again")
        return notes

    def alive(self) -> list[str]:
        return [p for p in self.last_seen if p not in self.dead]


async def wait_for_peers(ingest: Ingest, prompts: list[int], peers: list[str], deadline_s: float,
                         arrived: asyncio.Event) -> float:
    """Wait until every live peer's group on ``prompts`` is complete, at most ``deadline_s``; seconds waited."""
    start = time.time()
    while not ingest.peers_complete(prompts, peers):
        left = deadline_s - (time.time() - start)
        if left <= 0:
            break
        arrived.clear()
        try:
            await asyncio.wait_for(arrived.wait(), left)
        except TimeoutError:
            break
    return time.time() - start


class LearnerCore:
    """One worker's learner state for one model, held while the worker is a rank of its group.

    The worker drops it when it leaves the group (``Worker._switch_to``); a rank that
    joins later builds a fresh one and receives the whole state from rank 0.
    """

    def __init__(self, worker: Worker, model: str):
        self.worker, self.model_name = worker, model
        cfg = worker.cfg
        self.cfg, self.spec = cfg, cfg.models[worker.names.index(model)]
        self.tok, self.module, _ = worker.policy(model)
        self.module.train()
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        optimizer = adamw(self.module.parameters(), lr=self.spec.lr or cfg.train.lr, betas=cfg.train.adam_betas)
        # the objective's sampling RNG stays a CPU generator on any device: its state is what
        # sync_state broadcasts and state_digest hashes, and objectives draw from it on its own device
        rng = torch.Generator().manual_seed(cfg.run.seed * 1000 + worker.names.index(model))
        self.state = dp.TrainState(self.module, optimizer, rng)
        self.peers = [n for n in worker.names if n != model]
        self.sub: Subscriber | None = None  # leader only
        self.metrics: MetricsWriter | None = None
        self.last_stats = time.time()

    # --- leader-only inbox ---
    async def open_inbox(self) -> None:
        if self.sub is not None:
            return
        cache = tokenizer_cache(self.cfg)
        peers = {m.name: load_tokenizer(m.tokenizer, cache) for m in self.cfg.models if m.name != self.model_name}
        self.ingest = Ingest(self.spec, self.tok, peers, self.worker.task, self.cfg.train.group_size)
        self.watch = PeerWatch(self.peers, self.worker.pool.peer_dead_after_s, time.time())
        self.arrived = asyncio.Event()
        self.sub = Subscriber(self.worker.plan.broker_out, [f"exp.{n}" for n in self.worker.names],
                              name=f"{self.worker.id}.{self.model_name}")
        await self.sub.ready(timeout=60)
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: self.arrived.set())
        self.metrics = MetricsWriter(self.worker.plan.run_dir, self.model_name)
        self.store = WeightStore(self.worker.plan.run_dir, self.model_name)
        self.totals = {"own_experiences": 0, "peer_experiences": 0, "peer_misses": 0}

    async def _listen(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg, Experience):
                self.ingest.add(msg)
                if msg.model != self.model_name:
                    self.watch.heard(msg.model, time.time())
            self.arrived.set()

    def close(self) -> None:
        if self.sub is not None:
            self.listener.cancel()
            self.sub.close()
            self.metrics.close()

    # --- every rank ---
    def train_step(self, data: dp.StepData, own, peers, rank: int, world: int, started: float) -> dict:
        """This rank's share of the step, all-reduce, optimizer step; ``busy_until`` ends its compute budget.

        ``started`` is when the step began for this rank (the leader: prompts taken; a
        follower: header received). The caller pads the *whole* step (payload broadcast,
        weights published, digests taken) up to ``busy_until`` with ``pad_to_budget``: a
        stand-in GPU is busy for max(real work, budget), none of its per-step bookkeeping
        outside the budget.
        """
        own_r = [s for s in own if s.prompt_id in set(data.prompts[rank::world])]
        budget = self.worker.cost_s("train", self.model_name, started, len(own_r))
        self._set_lr()
        result = train_share(self.state, data, own, peers, rank, world, self.cfg.objective, self.pad_id,
                             self.cfg.train.grad_clip, 0.0, self._peers_for_objective)
        return {**result, "started": started, "busy_until": started + budget}

    @staticmethod
    async def pad_to_budget(result: dict) -> None:
        """Sleep out the rest of the step's budget; ``busy_s`` becomes the step's whole occupation."""
        await asyncio.sleep(max(0.0, result.pop("busy_until") - time.time()))
        result["busy_s"] = time.time() - result.pop("started")

    def _peers_for_objective(self, own, peers: list[PeerSample]) -> list[PeerSample]:
        kind = self.cfg.objective.kind
        if kind == "grpo":
            return []
        if kind == "xgrpo":
            return [Ingest.scalars_only(p) for p in peers]
        if kind == "sgt":
            failed = {s.prompt_id for s in own} - {s.prompt_id for s in own if s.verified}
            return [p for p in peers if p.verified and p.prompt_id in failed]
        return peers

    def _set_lr(self) -> None:
        warm = self.cfg.train.warmup_steps
        scale = min(1.0, (self.state.version + 1) / warm) if warm > 0 else 1.0
        for group in self.state.optimizer.param_groups:
            group["lr"] = (self.spec.lr or self.cfg.train.lr) * scale

    async def send_stats(self, consumed: int, busy: float, waited: float, queue: int = 0, peer_wait: float = 0.0,
                         staleness: float = 0.0) -> None:
        now = time.time()
        window = max(now - self.last_stats, 1e-6)
        self.last_stats = now
        await self.worker.pub.send(Stats(
            schema=SCHEMA_VERSION, worker_id=self.worker.id, role="learner", model=self.model_name, time=now,
            window_s=window, consumed_per_s=consumed / window, queue_depth=queue,
            idle_frac=min(max(1.0 - busy / window, 0.0), 1.0), staleness_mean=staleness, peer_wait_s=peer_wait,
            weight_version=self.state.version))


def train_share(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                pad_id: int, grad_clip: float, busy_until: float = 0.0, peer_filter=None) -> dict:
    """One data-parallel step: loss on prompts[rank::world], scaled by its share, grads summed, same update."""
    started = time.time()
    share = data.prompts[rank::world]
    mine = set(share)
    own_r = [s for s in own if s.prompt_id in mine]
    peers_r = [p for p in peers if p.prompt_id in mine]
    if peer_filter is not None:
        peers_r = peer_filter(own_r, peers_r)
    stats: dict = {}
    state.optimizer.zero_grad(set_to_none=True)
    if share:
        batch = build_batch(state.model, own_r, peers_r, share, state.version, pad_id, data.peer_version)
        batch = batch_to(batch, model_device(state.model))  # built on CPU; the loss runs where the weights are
        loss, stats = compute_loss(batch, objective, state.rng)
        (loss * len(share) / len(data.prompts)).backward()
    time.sleep(max(0.0, busy_until - time.time()))  # this rank's compute budget
    busy = time.time() - started
    dp.allreduce_grads(state.params)
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    state.optimizer.step()
    state.version += 1
    return {"busy_s": busy, "share_samples": len(own_r), "grad_norm": float(grad_norm),
            **{f"obj/{k}": float(v) for k, v in stats.items()}}


async def learn_role(worker: Worker, group: GroupSpec) -> None:
    """Serve as a rank of ``group`` and of every later formation that includes this worker."""
    model = group.model
    if model not in worker.learners:
        worker.learners[model] = LearnerCore(worker, model)
    core: LearnerCore = worker.learners[model]
    worker.role_now = ("learner", model)
    timeout = worker.pool.group_timeout_s
    try:
        while True:
            rank, world = group.members.index(worker.id), len(group.members)
            if rank == 0:
                await core.open_inbox()
            await asyncio.to_thread(dp.join, group.endpoint, rank, world, timeout)
            try:
                await asyncio.to_thread(dp.sync_state, core.state, rank)
                worker.acquired()  # a role switch's new memory is taken once the state has arrived
                await worker.plane.send(GroupFormed(worker.id, model, group.epoch, rank, core.state.version,
                                                    dp.state_digest(core.state)))
                core.last_stats = time.time()
                if rank == 0:
                    command, epoch = await _lead(core, group)
                else:
                    command, epoch = await _follow(core, group, rank, world)
            finally:
                dp.leave()
            if command == dp.STOP:
                if rank == 0:
                    await _finish(core)
                return
            while model not in worker.inbox.regroups or worker.inbox.regroups[model].epoch < epoch:
                if _reassigned(worker, model):
                    return  # the coordinator only tells the new formation's members about it
                worker.check_listener()
                await worker.inbox.wait()
            group = worker.inbox.regroups[model]
            if worker.id not in group.members:
                return
    finally:
        worker.role_now = None
        core.module.eval()
        worker.policy(model)[2] = core.state.version


def _reassigned(worker: Worker, model: str) -> bool:
    order = worker.inbox.order
    return order is not None and (order.assign.role, order.assign.model) != ("learner", model)


async def _lead(core: LearnerCore, group: GroupSpec) -> tuple[int, int]:
    worker, train = core.worker, core.cfg.train
    Q = train.prompts_per_step
    while True:
        waited_from = time.time()
        while True:  # a step boundary: stop and re-formation come before the next step
            worker.check_listener()
            if core.listener.done():
                core.listener.result()
            regroup = worker.inbox.regroups.get(group.model)
            if worker.inbox.halt:
                await asyncio.to_thread(dp.send_header, dp.STOP, group.epoch)
                return dp.STOP, group.epoch
            if regroup is not None and regroup.epoch > group.epoch:
                await asyncio.to_thread(dp.send_header, dp.REGROUP, regroup.epoch)
                return dp.REGROUP, regroup.epoch
            if core.ingest.complete_own_groups() >= Q:
                break
            core.arrived.clear()
            try:
                await asyncio.wait_for(core.arrived.wait(), worker.pool.tick_s)
            except TimeoutError:
                await asyncio.to_thread(dp.send_header, dp.TICK, group.epoch)
            _say(core, core.watch.update(time.time()))
        prompts = core.ingest.next_own_groups(Q)
        alive = core.watch.alive()
        peer_wait = 0.0
        if core.cfg.objective.kind != "grpo" and alive:
            peer_wait = await wait_for_peers(core.ingest, prompts, alive, train.peer_deadline_s, core.arrived)
        _say(core, core.watch.update(time.time()))
        idle = time.time() - waited_from
        own, peers, misses = core.ingest.take(prompts, alive)  # misses: live peers' incomplete groups
        solo = bool(core.peers) and not alive
        step_started = time.time()
        raw = dp.encode_step(prompts, own, peers, {}, misses, solo)
        await asyncio.to_thread(dp.send_header, dp.STEP, group.epoch, len(raw))
        await asyncio.to_thread(dp.broadcast_bytes, raw, len(raw))
        data, own_d, peers_d = dp.decode_step(raw)
        result = await asyncio.to_thread(core.train_step, data, own_d, peers_d, 0, len(group.members), step_started)
        await _after_step(core, group, prompts, own, peers, misses, solo, idle, peer_wait, result)


async def _after_step(core: LearnerCore, group: GroupSpec, prompts, own, peers, misses: int, solo: bool,
                      idle: float, peer_wait: float, result: dict) -> None:
    worker, version = core.worker, core.state.version
    await asyncio.to_thread(core.store.publish, core.module, version)
    digest = dp.params_digest(core.module)
    await core.pad_to_budget(result)  # the step's outputs are announced when its budget is spent
    await worker.pub.send(WeightsReady(schema=SCHEMA_VERSION, model=core.model_name, version=version, step=version,
                                       nbytes=0, time=time.time()))
    core.totals["own_experiences"] += len(own)
    core.totals["peer_experiences"] += len(peers)
    core.totals["peer_misses"] += misses
    rewards = [s.reward for s in own]
    staleness = sum(version - 1 - s.weight_version for s in own) / max(len(own), 1)
    core.metrics.write(
        event="step", step=version, weight_version=version, reward_mean=sum(rewards) / max(len(rewards), 1),
        staleness_mean=staleness, world=len(group.members), epoch=group.epoch, solo=solo,
        params_digest=digest,
        dead_peers=sorted(core.watch.dead), thl_residual_mean=(sum(p.residual for p in peers) / len(peers))
        if peers else None, idle_s=round(idle, 4), peer_wait_s=round(peer_wait, 4), **core.totals,
        **{k: v for k, v in result.items() if k != "share_samples"})
    await worker.plane.send(StepDone(core.model_name, version, group.epoch, len(group.members), prompts, misses, solo))
    await core.send_stats(result["share_samples"], result["busy_s"], idle, core.ingest.queued_own(), peer_wait,
                          staleness)


async def _follow(core: LearnerCore, group: GroupSpec, rank: int, world: int) -> tuple[int, int]:
    while True:
        command, epoch, nbytes = await asyncio.to_thread(dp.recv_header)
        step_started = time.time()
        if command == dp.TICK:
            continue
        if command in (dp.STOP, dp.REGROUP):
            return command, epoch
        raw = await asyncio.to_thread(dp.broadcast_bytes, None, nbytes)
        data, own, peers = dp.decode_step(raw)
        result = await asyncio.to_thread(core.train_step, data, own, peers, rank, world, step_started)
        await core.pad_to_budget(result)
        await core.send_stats(result["share_samples"], result["busy_s"], 0.0)


async def _finish(core: LearnerCore) -> None:
    """Drain what is still arriving, report what was never trained, checkpoint."""
    await asyncio.sleep(1.0)
    from policies.models import save_policy

    ckpt = f"{core.worker.plan.run_dir}/checkpoints/{core.model_name}"
    await asyncio.to_thread(save_policy, core.module, core.tok, ckpt)
    queued = list(core.ingest.complete)
    core.metrics.write(event="final", step=core.state.version, weight_version=core.state.version,
                       checkpoint=ckpt, queued_groups=len(queued), **core.totals)
    await core.worker.plane.send(LearnerFinal(core.model_name, core.state.version, queued,
                                              core.totals["own_experiences"]))


def _say(core: LearnerCore, notes: list[str]) -> None:
    for note in notes:
        print(f"[pool] {core.model_name}: {note}", file=sys.stderr, flush=True)
        core.metrics.write(event="peer_status", step=core.state.version, note=note, dead_peers=sorted(core.watch.dead))
