"""The learner role: one rank of a model's learner group (``engine.train.group`` has the protocol).

The leader (rank 0) keeps the model's inbox (``engine.train.ingest.Ingest``: own groups,
peer samples bridged by the THL on arrival), picks each step's prompts, broadcasts the
step's samples, publishes the new weights to the model's channel, and at the end saves
the checkpoint and runs the final held-out evaluation. The coordinator never moves a
leader while its group exists, so buffered experience never changes hands.

With ``train.sharding = "fsdp2"`` a formation of several ranks trains a ``ShardedTwin``
(``engine.train.sharding``): built from rank 0's state once ``sync_state`` has run, gathered
back into the leader's state when the formation ends; every rank joins the gathers after a
step (weights the leader publishes) and before a checkpoint (AdamW moments).

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
import functools
import math
import sys
import time
from pathlib import Path

from engine.prep.evaluation import held_out_accuracy
from policies.templates import prompt_format
from engine.roles.learner_core import LearnerCore, Pending
from engine.roles.memory import trim_heap
from engine.failures import SHARDS_LOST
from engine.runtime.plane import (REWARD_FAILED, GroupBroken, GroupFormed, GroupSpec, LearnerFinal, StepDone,
                                  StepReport)
from engine.train import checkpoint
from engine.train import group as dp
from engine.train.sharding import ShardedTwin
from engine.train.step import learning_rate, peers_for, train_share
from engine.train.trl_metrics import trl_step_metrics
from exchange.log import fsync_log
from exchange.protocol import SCHEMA_VERSION, Stats, WeightsReady
from tasks.base import VerifierError
from tasks.rewards import user_judged

STOP, REGROUP, BROKEN, FINISHED = "stop", "regroup", "broken", "finished"


async def learn_role(worker, group: GroupSpec) -> None:
    """Serve as a rank of ``group`` and of every later formation of it that includes this worker."""
    model = group.model
    if model not in worker.learners:
        if group.restore:  # a sharded group restarting from a checkpoint: start from it (not the warm start)
            worker.resume[model] = group.restore
        worker.learners[model] = LearnerCore(worker, model)
    core: LearnerCore = worker.learners[model]
    worker.role_now = ("learner", model)
    try:
        while True:
            rank = group.members.index(worker.id)
            if group.restore and core.resume != group.restore:  # every rank, once: the coordinator rewound too
                core = _restarted_core(worker, model, group.restore)
            outcome = await _serve(core, group, rank)
            if outcome in (STOP, FINISHED):
                if rank == 0:
                    await _finish(core, stopped_early=outcome == STOP)
                return
            group = await _next_formation(worker, model, group.epoch)
            if group is None or worker.id not in group.members:
                if worker.inbox.halt and core.sub is not None and not core.lost:
                    await _finish(core, stopped_early=True)  # a leader halted between formations
                return
    finally:
        worker.role_now = None
        core.module.eval()
        worker.policy(model).version = core.state.version


def _restarted_core(worker, model: str, path: str) -> LearnerCore:
    """This rank's state (lost with its sharded formation, or kept whole by a leader) rebuilt from the checkpoint
    the next formation names (its leader publishes those weights and replays the log, as a resumed run's does)."""
    old = worker.learners.pop(model, None)
    if old is not None:
        old.close()
    worker.policies.pop(model, None)
    worker.resume[model] = path
    core = worker.learners[model] = LearnerCore(worker, model)
    return core


async def _serve(core: LearnerCore, group: GroupSpec, rank: int) -> str:
    """One formation: join, take rank 0's state, then lead or follow until it ends."""
    w, world, timeout = core.worker, len(group.members), core.cfg.timeouts.group_form_s
    try:
        if core.lost:  # never lead or sync from a state a broken sharded formation left half-gathered
            raise dp.GroupError("this rank's sharded state was lost and the formation names no checkpoint")
        if rank == 0:
            fresh = core.sub is None
            await core.open_inbox()
            if fresh and group.trained is not None and core.resume is None:
                await core.take_over(group.trained)
        sharded = world > 1 and core.cfg.train.sharding == "fsdp2"
        backend = "cpu:gloo,cuda:nccl" if sharded and w.device.type == "cuda" else "gloo"
        if world > 1:
            await asyncio.to_thread(dp.join, group.endpoint, rank, world, timeout, backend)
            await asyncio.to_thread(dp.sync_state, core.state, rank)
        digest = dp.state_digest(core.state)
        if rank == 0:  # generators ask the leader the weight path names (broadcast): this one, from now on
            await asyncio.to_thread(core.writer.take_lead, core.state.version)
        if sharded:
            t = core.cfg.train
            core.twin = await asyncio.to_thread(dp.collective(ShardedTwin), core.state, rank == 0, w.device,
                                                t.adam_betas, t.grad_accum, t.activation_checkpointing,
                                                t.mixed_precision == "bf16")
        w.acquired()  # a role switch's new memory is taken once the state has arrived
        await w.plane.send(GroupFormed(w.id, group.model, group.epoch, rank, core.state.version, digest))
        core.last_stats = time.time()
        outcome = await (_lead(core, group) if rank == 0 else _follow(core, group, rank))
        if core.twin is not None:  # every rank, at the boundary the leader's header named
            await asyncio.to_thread(dp.collective(core.twin.close))
            core.twin = None
        return outcome
    except dp.GroupError as exc:
        why = str(exc).split(". ")[0][:240]  # gloo appends advice and an emoji
        if core.twin is not None:  # a dead rank's shards are gone: engine.failures restarts the group
            core.twin.abandon()
            core.twin, core.lost = None, True
        if core.lost:
            why = f"{SHARDS_LOST}: {why}"
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
    cut = ingest.cut_in(prompts)
    own, peers, misses = ingest.take(prompts, alive if waits else [])
    read = ingest.reference_samples(prompts) if core.need == "reference" else peers
    raw = dp.encode_step(prompts, own, peers_for(core.need, own, read), {}, misses, bool(core.peers) and not alive)
    return Pending(prompts, raw, own, peers, misses, bool(core.peers) and not alive, idle + peer_wait, peer_wait, cut)


async def _train(core: LearnerCore, raw: bytes, rank: int, world: int) -> dict:
    data, own, peers = dp.decode_step(raw)
    started = time.time()
    lr = learning_rate(core.lr, core.state.version, core.cfg.train.warmup_steps)
    step = dp.collective(core.twin.step) if core.twin is not None else \
        functools.partial(train_share, core.state, accum=core.cfg.train.grad_accum)
    result = await asyncio.to_thread(step, data, own, peers, rank, world, core.cfg.objective, core.pad_id,
                                     core.cfg.train.grad_clip, lr)
    if core.worker.device.type == "cpu":
        await asyncio.to_thread(trim_heap)  # the step's activations back to the machine until the next step
    await core.worker.pad_to_budget("train", core.model_name, started, result["share_samples"])
    result["busy_s"] = time.time() - started
    result["peer_used"] = len(peers)
    result["learning_rate"] = lr
    return result


def _reward_means(task, own: list) -> dict[str, float | None]:
    """Each reward function's mean over the step's own samples, under TRL's name ``rewards/<name>/mean`` (None
    where it abstained on all of them); nothing without ``[reward] funcs``."""
    names = getattr(task, "names", None)
    if not names:
        return {}
    out = {}
    for i, name in enumerate(names):
        judged = [s.reward_parts[i] for s in own if len(s.reward_parts) > i and not math.isnan(s.reward_parts[i])]
        out[f"rewards/{name}/mean"] = sum(judged) / len(judged) if judged else None
    return out


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
        truncated_frac=p.cut / n,  # own samples cut at train.max_new_tokens: RL learns what fits the cap
        staleness_mean=sum(version - 1 - s.weight_version for s in p.own) / n,
        thl_residual_mean=sum(s.residual for s in p.peers) / len(p.peers) if p.peers else None,
        thl_residual_by_peer=_mean_by_peer(p.peers),
        thl_failures=core.ingest.failures, peer_late=core.ingest.late, peer_batch=len(p.peers),
        rejected=core.ingest.rejected_total,
        world=len(group.members), epoch=group.epoch, solo=p.solo, peers_gone=sorted(w.inbox.gone),
        idle_s=round(p.idle_s, 4), peer_wait_s=round(p.peer_wait_s, 4), step_s=round(result.pop("busy_s"), 4),
        **_reward_means(w.task, p.own), **t, **result)
    record.update(trl_step_metrics(p.own, record["learning_rate"], result, getattr(w.task, "names", ())))
    if core.cfg.pool.script or core.cfg.pool.allocator == "mwra":
        record["params_digest"] = dp.params_digest(core.module)  # lets a test check every hand-over bit for bit
    ev, live_n = core.cfg.eval, 0
    if ev.every_steps and version % ev.every_steps == 0 and version < core.cfg.train.steps:
        res = await asyncio.to_thread(held_out_accuracy, core.module, core.tok, prompt_format(core.spec), w.task,
                                      ev.live_problems, ev, core.cfg.eval_max_new_tokens,
                                      f"{core.model_name} live at step {version} (eval.live_problems)",
                                      False, core.cfg.train.reward_errors)  # no result line: the display's acc@N
        record.update(accuracy=res.accuracy, accuracy_stderr=res.stderr, eval_truncated=res.truncated)
        live_n = res.n  # the display's acc@N: the problems there were, not the number configured
    if _checkpoint_due(core):
        started = time.time()
        await _gather_moments(core)
        path = await asyncio.to_thread(_checkpoint, core)
        if core.twin is not None:
            core.twin.drop_moments()
        record.update(checkpoint=str(path), checkpoint_s=round(time.time() - started, 3))
    core.metrics.write(event="step", prompts=p.prompts, **record)
    core.log_scalars(version, record)
    report = StepReport(record["reward_mean"], record["staleness_mean"], record["step_s"], t["own_experiences"],
                        t["peer_experiences"], record.get("accuracy"), t["peer_used"], record["truncated_frac"],
                        record.get("eval_truncated"), live_n)
    await w.plane.send(StepDone(core.model_name, version, group.epoch, len(group.members), p.prompts, p.misses,
                                p.solo, report))
    await _send_stats(core, len(p.own), record["step_s"], p.idle_s, core.ingest.queued_own(), p.peer_wait_s,
                      record["staleness_mean"])


def _checkpoint_due(core: LearnerCore) -> bool:
    """A periodic checkpoint after the step just taken (every rank knows: sharded ones gather the moments)."""
    every, version = core.cfg.run.checkpoint_every, core.state.version
    return bool(every) and version % every == 0 and version < core.cfg.train.steps


async def _gather_moments(core: LearnerCore) -> None:
    """A sharded formation's AdamW moments, whole, into the leader's optimizer (every rank joins)."""
    if core.twin is not None:
        await asyncio.to_thread(dp.collective(core.twin.gather_moments))


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
        if _checkpoint_due(core):
            await _gather_moments(core)
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


class _NotEvaluated:
    accuracy = stderr = truncated = None
    n = 0


NOT_EVALUATED = _NotEvaluated()  # a final evaluation the task's scoring could not run: no figures, not zeros


async def _finish(core: LearnerCore, stopped_early: bool) -> None:
    """Checkpoint, evaluate on held-out problems, report what was never trained."""
    cfg, w = core.cfg, core.worker
    ckpt = str(await asyncio.to_thread(_checkpoint, core))
    if w.inbox.halt_reason == REWARD_FAILED and user_judged(w.task):  # it would call the failed function again
        print(f"[{core.model_name}] no final evaluation: a success is judged by the reward functions, and one "
              "failed", file=sys.stderr, flush=True)
        res = NOT_EVALUATED
    else:
        try:
            res = await asyncio.to_thread(held_out_accuracy, core.module, core.tok, prompt_format(core.spec), w.task,
                                          cfg.eval.num_problems, cfg.eval, cfg.eval_max_new_tokens,
                                          f"{core.model_name} final (held-out)", True, cfg.train.reward_errors)
        except VerifierError as exc:  # the task's scoring failed here first: the checkpoint stands, no figures
            print(f"[{core.model_name}] no final evaluation: {exc}", file=sys.stderr, flush=True)
            res = NOT_EVALUATED
    queued = list(core.ingest.complete)
    t = core.totals
    core.log_scalars(core.state.version, {"final_accuracy": res.accuracy, "final_accuracy_stderr": res.stderr,
                                          "final_truncated": res.truncated})
    core.metrics.write(event="final", step=core.state.version, weight_version=core.state.version,
                       accuracy=res.accuracy, accuracy_stderr=res.stderr, eval_n=res.n, truncated=res.truncated,
                       wall_s=round(time.time() - core.started, 2), checkpoint=ckpt,
                       warm_checkpoint=w.plan.warm_checkpoints[core.model_name], stopped_early=stopped_early,
                       queued_groups=len(queued), rejected=core.ingest.rejected_total,
                       rejected_by=dict(core.ingest.rejected), **core.warm, **t)
    await w.plane.send(LearnerFinal(core.model_name, core.state.version, queued, ckpt, res.accuracy, res.stderr,
                                    res.n, t["own_experiences"], t["peer_experiences"], t["peer_used"], stopped_early,
                                    res.truncated))
