"""The learner role: one rank of a model's learner group (``engine.train.group`` has the protocol).

The leader (rank 0) keeps the model's inbox (``engine.train.ingest.Ingest``: own groups,
peer samples bridged by the THL on arrival), picks each step's prompts, broadcasts the
step's samples, publishes the new weights to the model's channel, and at the end saves
the checkpoint and runs the final held-out evaluation. The coordinator never moves a
leader while its group exists, so buffered experience never changes hands.

No deadlock, no starvation:
- peers' groups on a step's prompts are waited for at most ``timeouts.peer_wait_s``, and
  only for what the objective reads (``policies.objectives.peer_need``); misses are counted;
- a peer the coordinator declares gone (``PeersGone``: it finished, died, or went silent)
  is not waited for again: the learner says so once, and every step record says ``solo``;
- a leader waiting for data sends ``TICK`` headers, so followers blocked in a collective
  stay inside the group's time-out;
- a collective that fails (a rank died) ends the formation: every rank reports
  ``GroupBroken`` and waits for the coordinator's next one; a step whose all-reduce failed
  is retried there, on the same samples.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import tokenizer_cache
from engine.prep.evaluation import held_out_accuracy
from engine.runtime.metrics import MetricsWriter
from engine.runtime.tbevents import EventWriter
from engine.runtime.plane import GroupBroken, GroupFormed, GroupSpec, LearnerFinal, StepDone, StepReport
from engine.train import checkpoint
from engine.train import group as dp
from engine.train.ingest import Ingest
from engine.train.optim import adamw
from engine.train.step import learning_rate, peers_for, train_share
from engine.weights.channel import WeightWriter
from exchange.log import ExperienceLogReader, fsync_log
from exchange.protocol import SCHEMA_VERSION, Experience, Stats, WeightsReady
from exchange.transport import Subscriber
from policies.models import pad_token_id
from policies.objectives import peer_need
from tokenbridge import load_tokenizer

STOP, REGROUP, BROKEN, FINISHED = "stop", "regroup", "broken", "finished"
MAX_INGEST_BATCH = 256  # experiences bridged at once: bounds how long one ingest holds the event loop


@dataclass
class Pending:
    """A leader's next step, kept until its optimizer step happened (retried after a broken formation)."""

    prompts: list[int]
    raw: bytes  # the step payload every rank trains on
    own: list
    peers: list  # every peer sample that arrived for the prompts (the objective may read fewer)
    misses: int
    solo: bool
    idle_s: float
    peer_wait_s: float


class LearnerCore:
    """A model's training state on this worker (every rank), and the inbox (the leader only)."""

    def __init__(self, worker, model: str):
        self.worker, self.model_name = worker, model
        cfg = worker.cfg
        self.cfg, self.spec = cfg, cfg.model(model)
        policy = worker.policy(model)
        self.tok, self.module = policy.tokenizer, policy.module
        self.module.train()
        self.pad_id = pad_token_id(self.tok)
        self.lr = self.spec.lr or cfg.train.lr
        optimizer = adamw(self.module.parameters(), lr=self.lr, betas=cfg.train.adam_betas)
        # a CPU generator on any device: its state is what sync_state broadcasts and state_digest hashes
        rng = torch.Generator().manual_seed(cfg.run.seed * 1000 + cfg.names.index(model))
        self.state = dp.TrainState(self.module, optimizer, rng)
        self.totals = {"own_experiences": 0, "peer_experiences": 0, "peer_used": 0, "peer_misses": 0,
                       "staleness_dropped": 0}
        self.consumed: set[int] = set()  # prompts trained before this run was resumed
        self.resume = worker.resume.pop(model, None)  # a resumed run's checkpoint: taken once per worker
        if self.resume is not None:  # every rank: the group's state_digest must agree before the first step
            self.consumed = checkpoint.restore(Path(self.resume), self.state, self.totals, worker.device)
        self.peers = [n for n in cfg.names if n != model]
        self.need = peer_need(cfg.objective.kind)
        self.sub: Subscriber | None = None  # the leader's inbox, once opened
        self.pending: Pending | None = None
        self.announced: set[str] = set()
        self.started = self.last_stats = time.time()

    async def open_inbox(self) -> None:
        if self.sub is not None:
            return
        w = self.worker
        cache = tokenizer_cache(self.cfg)
        peers = {n: load_tokenizer(self.cfg.model(n).tokenizer, cache) for n in self.peers}
        self.ingest = Ingest(self.spec, self.tok, peers, w.task, self.cfg.train.group_size, w.plan.run_id)
        self.ingest.consumed.update(self.consumed)
        self.sub = Subscriber(w.plan.broker_out, [f"exp.{n}" for n in self.cfg.names], name=f"{w.id}.{self.model_name}")
        await self.sub.ready(timeout=self.cfg.timeouts.worker_start_s)
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: w.inbox.changed.set())
        self.metrics = MetricsWriter(w.plan.run_dir, self.model_name)
        self.writer = WeightWriter(w.plan_channel(self.model_name), self.module)
        acc = w.plan.warm_accuracy.get(self.model_name, [None, None])
        self.warm = {"warm_accuracy": acc[0], "warm_accuracy_stderr": acc[1]}
        self.metrics.write(event="start", step=self.state.version, weight_version=self.state.version, **self.warm)
        tb_dir = Path(w.plan.run_dir) / "tensorboard" / self.model_name
        self.tb = EventWriter(tb_dir) if self.cfg.run.tensorboard else None
        self.log_scalars(self.state.version, self.warm)
        if self.resume is not None:
            await self._resume()

    async def _resume(self) -> None:
        """Generators get the checkpoint's weights; the log's experience of untrained prompts comes back in."""
        await asyncio.to_thread(self.writer.publish, self.state.version)
        replayed = await self._replay_log()
        self.metrics.write(event="resume", step=self.state.version, consumed=len(self.consumed),
                           replayed=replayed, checkpoint=self.resume)

    async def _replay_log(self) -> int:
        """Every logged experience of a prompt not trained yet goes to the inbox (which keeps the first copy of
        each sample); returns how many were read."""
        log = ExperienceLogReader(Path(self.worker.plan.run_dir) / "experience_log")
        consumed = self.ingest.consumed
        replay = [e for e in log if e.prompt_id not in consumed and e.model in self.cfg.names]
        for i in range(0, len(replay), MAX_INGEST_BATCH):
            self.ingest.add_many(replay[i:i + MAX_INGEST_BATCH])
            await asyncio.sleep(0)
        self.worker.inbox.changed.set()
        return len(replay)

    def broker_restarted(self, restarts: int) -> None:
        """A new broker: once it has our subscription, the log holds whatever the old one never routed to us."""
        if self.sub is not None:
            self.rejoin = asyncio.create_task(self._rejoin_broker(restarts))

    async def _rejoin_broker(self, restarts: int) -> None:
        try:
            await self.sub.resubscribe(self.cfg.timeouts.worker_start_s)
        except TimeoutError as exc:
            print(f"[{self.worker.id}] {self.model_name}: {exc}", file=sys.stderr, flush=True)
            return
        before = len(self.ingest.seen)
        replayed = await self._replay_log()
        self.metrics.write(event="broker_replay", step=self.state.version, restarts=restarts, read=replayed,
                           recovered=len(self.ingest.seen) - before)

    async def _listen(self) -> None:
        while True:  # what has arrived meanwhile comes as one batch: its peer completions cross the THL together
            msgs = await self.sub.recv_batch(MAX_INGEST_BATCH)
            self.ingest.add_many([m for m in msgs if isinstance(m, Experience)])
            self.worker.inbox.changed.set()

    def log_scalars(self, step: int, record: dict) -> None:
        if self.tb is not None:
            self.tb.scalars(step, record)

    def check(self) -> None:
        self.worker.check_listener()
        if self.sub is not None and self.listener.done():
            self.listener.result()  # never train on a dead inbox

    def alive_peers(self) -> list[str]:
        return [p for p in self.peers if p not in self.worker.inbox.gone]

    def announce_gone(self) -> None:
        """Say once, at the first step trained without it, that (and why) a peer is gone, and if it comes back."""
        gone = self.worker.inbox.gone
        for peer in sorted(self.announced - set(gone)):
            self.announced.discard(peer)
            print(f"[{self.model_name}] peer {peer} is back: waiting for its groups again", file=sys.stderr, flush=True)
            self.metrics.write(event="peer_back", step=self.state.version, peer=peer)
        for peer, why in gone.items():
            if peer in self.announced or peer not in self.peers:
                continue
            self.announced.add(peer)
            left = self.alive_peers()
            how = "solo" if not left else f"with {', '.join(left)} only"
            print(f"[{self.model_name}] peer {peer} sends no more experience ({why}): training {how} from step "
                  f"{self.state.version + 1}", file=sys.stderr, flush=True)
            self.metrics.write(event="peer_gone", step=self.state.version, peer=peer, reason=why, training=how)

    def close(self) -> None:
        if self.sub is not None:
            self.listener.cancel()
            self.sub.close()
            self.writer.close()
            self.metrics.close()
            if self.tb is not None:
                self.tb.close()
            self.sub = None


async def learn_role(worker, group: GroupSpec) -> None:
    """Serve as a rank of ``group`` and of every later formation of it that includes this worker."""
    model = group.model
    if model not in worker.learners:
        worker.learners[model] = LearnerCore(worker, model)
    core: LearnerCore = worker.learners[model]
    worker.role_now = ("learner", model)
    try:
        while True:
            rank = group.members.index(worker.id)
            outcome = await _serve(core, group, rank)
            if outcome in (STOP, FINISHED):
                if rank == 0:
                    await _finish(core, stopped_early=outcome == STOP)
                return
            group = await _next_formation(worker, model, group.epoch)
            if group is None or worker.id not in group.members:
                if worker.inbox.halt and core.sub is not None:
                    await _finish(core, stopped_early=True)  # a leader halted between formations
                return
    finally:
        worker.role_now = None
        core.module.eval()
        worker.policy(model).version = core.state.version


async def _serve(core: LearnerCore, group: GroupSpec, rank: int) -> str:
    """One formation: join, take rank 0's state, then lead or follow until it ends."""
    w, world, timeout = core.worker, len(group.members), core.cfg.timeouts.group_form_s
    if rank == 0:
        await core.open_inbox()
    try:
        if world > 1:
            await asyncio.to_thread(dp.join, group.endpoint, rank, world, timeout)
            await asyncio.to_thread(dp.sync_state, core.state, rank)
        w.acquired()  # a role switch's new memory is taken once the state has arrived
        await w.plane.send(GroupFormed(w.id, group.model, group.epoch, rank, core.state.version,
                                       dp.state_digest(core.state)))
        core.last_stats = time.time()
        return await (_lead(core, group) if rank == 0 else _follow(core, group, rank))
    except dp.GroupError as exc:
        why = str(exc).split(". ")[0][:240]  # gloo appends advice and an emoji
        print(f"[{w.id}] {group.model} learner group epoch {group.epoch}: {why}", file=sys.stderr, flush=True)
        await w.plane.send(GroupBroken(w.id, group.model, group.epoch, why))
        return BROKEN
    finally:
        if world > 1:
            dp.leave()


async def _next_formation(worker, model: str, epoch: int) -> GroupSpec | None:
    """The next formation of ``model``'s group; None if the worker was halted or given another role."""
    while True:
        group = worker.inbox.regroups.get(model)
        if group is not None and group.epoch > epoch:
            return group
        order = worker.inbox.order
        if worker.inbox.halt or (order and (order.assign.role, order.assign.model) != ("learner", model)):
            return None
        worker.check_listener()
        await worker.inbox.wait()


async def _boundary(core: LearnerCore, group: GroupSpec) -> str | None:
    """Wait at a step boundary until there is a step to take (None) or the formation ends (its command)."""
    w, world, Q = core.worker, len(group.members), core.cfg.train.prompts_per_step
    tick = core.cfg.timeouts.tick_s
    last_header = time.time()
    while True:
        core.check()
        core.announce_gone()
        regroup = w.inbox.regroups.get(group.model)
        command = (STOP if w.inbox.halt else REGROUP if regroup and regroup.epoch > group.epoch
                   else FINISHED if core.state.version >= core.cfg.train.steps else None)
        if command is not None:
            if world > 1:
                epoch = regroup.epoch if command == REGROUP else group.epoch
                await asyncio.to_thread(dp.send_header, dp.REGROUP if command == REGROUP else dp.STOP, epoch)
            return command
        if core.pending is not None or core.ingest.complete_own_groups() >= Q:
            return None
        await w.inbox.wait(tick)
        if world > 1 and time.time() - last_header >= tick:
            await asyncio.to_thread(dp.send_header, dp.TICK, group.epoch)  # keeps followers inside the time-out
            last_header = time.time()


async def _lead(core: LearnerCore, group: GroupSpec) -> str:
    world = len(group.members)
    while True:
        waited_from = time.time()
        command = await _boundary(core, group)
        if command is not None:
            return command
        if core.pending is None:
            core.pending = await _prepare(core, time.time() - waited_from)
        p = core.pending
        if world > 1:
            await asyncio.to_thread(dp.send_header, dp.STEP, group.epoch, len(p.raw))
            await asyncio.to_thread(dp.broadcast_bytes, p.raw, len(p.raw))
        result = await _train(core, p.raw, 0, world)
        core.pending = None  # the optimizer step happened: never retried
        await _after_step(core, group, p, result)


async def _prepare(core: LearnerCore, idle: float) -> Pending:
    """The next step's prompts and samples: own groups, and the peers' groups the objective reads."""
    cfg, ingest = core.cfg, core.ingest
    prompts = ingest.next_own_groups(cfg.train.prompts_per_step)
    alive = core.alive_peers()
    started = time.time()
    waits = core.need not in ("none", "reference")  # the answer-key control reads no peer
    while waits and alive and not ingest.peers_complete(prompts, alive):
        left = cfg.timeouts.peer_wait_s - (time.time() - started)
        if left <= 0 or core.worker.inbox.halt:
            break
        await core.worker.inbox.wait(left)
        alive = core.alive_peers()
    peer_wait = time.time() - started
    own, peers, misses = ingest.take(prompts, alive if waits else [])
    read = ingest.reference_samples(prompts) if core.need == "reference" else peers
    raw = dp.encode_step(prompts, own, peers_for(core.need, own, read), {}, misses, bool(core.peers) and not alive)
    return Pending(prompts, raw, own, peers, misses, bool(core.peers) and not alive, idle + peer_wait, peer_wait)


async def _train(core: LearnerCore, raw: bytes, rank: int, world: int) -> dict:
    data, own, peers = dp.decode_step(raw)
    started = time.time()
    lr = learning_rate(core.lr, core.state.version, core.cfg.train.warmup_steps)
    result = await asyncio.to_thread(train_share, core.state, data, own, peers, rank, world, core.cfg.objective,
                                     core.pad_id, core.cfg.train.grad_clip, lr)
    await core.worker.pad_to_budget("train", core.model_name, started, result["share_samples"])
    result["busy_s"] = time.time() - started
    result["peer_used"] = len(peers)
    return result


async def _after_step(core: LearnerCore, group: GroupSpec, p: Pending, result: dict) -> None:
    """Publish the weights, then tell everyone: metrics, the coordinator, the Stats stream."""
    w, version, t = core.worker, core.state.version, core.totals
    await asyncio.to_thread(core.writer.publish, version)
    await w.pub.send(WeightsReady(schema=SCHEMA_VERSION, model=core.model_name, version=version, step=version,
                                  nbytes=core.writer.nbytes, time=time.time()))
    t["own_experiences"] += len(p.own)
    t["peer_experiences"] += len(p.peers)
    t["peer_used"] += result.pop("peer_used")
    t["peer_misses"] += p.misses
    t["staleness_dropped"] += int(result.get("obj/staleness_dropped", 0))
    rewards = [s.reward for s in p.own]
    n = max(len(p.own), 1)
    record = dict(
        step=version, weight_version=version, reward_mean=sum(rewards) / n,
        solve_rate=sum(s.verified for s in p.own) / n,
        staleness_mean=sum(version - 1 - s.weight_version for s in p.own) / n,
        thl_residual_mean=sum(s.residual for s in p.peers) / len(p.peers) if p.peers else None,
        thl_residual_by_peer=_mean_by_peer(p.peers),
        thl_failures=core.ingest.failures, peer_late=core.ingest.late, peer_batch=len(p.peers),
        rejected=core.ingest.rejected_total,
        world=len(group.members), epoch=group.epoch, solo=p.solo, peers_gone=sorted(w.inbox.gone),
        idle_s=round(p.idle_s, 4), peer_wait_s=round(p.peer_wait_s, 4), step_s=round(result.pop("busy_s"), 4),
        **t, **result)
    if core.cfg.pool.script or core.cfg.pool.allocator == "mwra":
        record["params_digest"] = dp.params_digest(core.module)  # lets a test check every hand-over bit for bit
    ev = core.cfg.eval
    if ev.every_steps and version % ev.every_steps == 0 and version < core.cfg.train.steps:
        res = await asyncio.to_thread(held_out_accuracy, core.module, core.tok, core.spec.arch, w.task,
                                      ev.live_problems, ev, core.cfg.train.max_new_tokens,
                                      f"{core.model_name} live at step {version} (eval.live_problems)")
        record.update(accuracy=res.accuracy, accuracy_stderr=res.stderr)
    every = core.cfg.run.checkpoint_every
    if every and version % every == 0 and version < core.cfg.train.steps:
        started = time.time()
        path = await asyncio.to_thread(_checkpoint, core)
        record.update(checkpoint=str(path), checkpoint_s=round(time.time() - started, 3))
    core.metrics.write(event="step", prompts=p.prompts, **record)
    core.log_scalars(version, record)
    report = StepReport(record["reward_mean"], record["staleness_mean"], record["step_s"], t["own_experiences"],
                        t["peer_experiences"], record.get("accuracy"), t["peer_used"])
    await w.plane.send(StepDone(core.model_name, version, group.epoch, len(group.members), p.prompts, p.misses,
                                p.solo, report))
    await _send_stats(core, len(p.own), record["step_s"], p.idle_s, core.ingest.queued_own(), p.peer_wait_s,
                      record["staleness_mean"])


def _checkpoint(core: LearnerCore) -> Path:
    """fsync the experience log, then checkpoint: every experience the checkpoint counts as consumed, and all
    logged before it, is on disk with it (the broker hands the log to the kernel before it routes anything)."""
    run_dir = core.worker.plan.run_dir
    fsync_log(Path(run_dir) / "experience_log")
    return checkpoint.save(run_dir, core, core.cfg.run.keep_checkpoints)


def _mean_by_peer(peers: list) -> dict[str, float]:
    """Mean THL residual of this step's bridged samples, per sending model."""
    by: dict[str, list[float]] = {}
    for s in peers:
        by.setdefault(s.model, []).append(s.residual)
    return {m: round(sum(v) / len(v), 4) for m, v in by.items()}


async def _follow(core: LearnerCore, group: GroupSpec, rank: int) -> str:
    world = len(group.members)
    while True:
        command, _, nbytes = await asyncio.to_thread(dp.recv_header)
        if command == dp.TICK:
            continue
        if command in (dp.STOP, dp.REGROUP):
            return STOP if command == dp.STOP else REGROUP
        raw = await asyncio.to_thread(dp.broadcast_bytes, None, nbytes)
        result = await _train(core, raw, rank, world)
        await _send_stats(core, result["share_samples"], result["busy_s"], 0.0)


async def _send_stats(core: LearnerCore, consumed: int, busy: float, idle: float, queue: int = 0,
                      peer_wait: float = 0.0, staleness: float = 0.0) -> None:
    now = time.time()
    window = max(now - core.last_stats, 1e-6)
    core.last_stats = now
    await core.worker.pub.send(Stats(
        schema=SCHEMA_VERSION, worker_id=core.worker.id, role="learner", model=core.model_name, time=now,
        window_s=window, consumed_per_s=consumed / window, queue_depth=queue,
        idle_frac=min(max(1.0 - busy / window, 0.0), 1.0), staleness_mean=staleness, peer_wait_s=peer_wait,
        weight_version=core.state.version))


async def _finish(core: LearnerCore, stopped_early: bool) -> None:
    """Checkpoint, evaluate on held-out problems, report what was never trained."""
    cfg, w = core.cfg, core.worker
    ckpt = str(await asyncio.to_thread(_checkpoint, core))
    res = await asyncio.to_thread(held_out_accuracy, core.module, core.tok, core.spec.arch, w.task,
                                  cfg.eval.num_problems, cfg.eval, cfg.train.max_new_tokens,
                                  f"{core.model_name} final (held-out)")
    queued = list(core.ingest.complete)
    t = core.totals
    core.log_scalars(core.state.version, {"final_accuracy": res.accuracy, "final_accuracy_stderr": res.stderr})
    core.metrics.write(event="final", step=core.state.version, weight_version=core.state.version,
                       accuracy=res.accuracy, accuracy_stderr=res.stderr, eval_n=res.n,
                       wall_s=round(time.time() - core.started, 2), checkpoint=ckpt,
                       warm_checkpoint=w.plan.warm_checkpoints[core.model_name], stopped_early=stopped_early,
                       queued_groups=len(queued), rejected=core.ingest.rejected_total,
                       rejected_by=dict(core.ingest.rejected), **core.warm, **t)
    await w.plane.send(LearnerFinal(core.model_name, core.state.version, queued, ckpt, res.accuracy, res.stderr,
                                    res.n, t["own_experiences"], t["peer_experiences"], t["peer_used"], stopped_early))
