"""Generator actor: prompts in, scored Experience out, weights swapped between batches.

Loop invariants:
- A batch is generated with one weight version from start to end; new weights are
  loaded only between batches (and only when a newer version was announced).
- The generator never waits for its learner, except when a batch demands a newer
  version than it holds (``PromptBatch.min_weight_version``, synchronous mode).
- The behaviour log-probs published are those of the distribution sampled from.
"""

from __future__ import annotations

import asyncio
import collections
import time

import torch

from engine import weightsync
from engine.config import tokenizer_cache
from engine.plan import WorkerPlan
from exchange.protocol import (
    SCHEMA_VERSION,
    Control,
    Experience,
    PromptBatch,
    Stats,
    WeightsReady,
    pack_floats,
    pack_ids,
)
from exchange.transport import Publisher, Subscriber
from policies.backend import HFBackend
from policies.models import build_policy
from policies.templates import prompt_ids
from tasks.base import Problem
from tasks.registry import make_task
from tokenbridge import load_tokenizer


class _Inbox:
    """What has arrived: pending prompt batches, the newest announced version, stop."""

    def __init__(self) -> None:
        self.batches: collections.deque[PromptBatch] = collections.deque()
        self.announced = 0
        self.stop = False
        self.changed = asyncio.Event()


async def run(payload: bytes) -> int:
    plan = WorkerPlan.decode(payload)
    spec = plan.model
    cfg = plan.config
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    model = build_policy(_with_checkpoint(spec, plan.warm_checkpoint), tokenizer)
    backend = HFBackend(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=_pad(tokenizer))
    task = make_task(cfg.task)

    sub = Subscriber(plan.broker_out, topics=[f"prompts.{spec.name}", f"weights.{spec.name}", "ctl"], name=plan.worker_id)
    pub = Publisher(plan.broker_in)
    await sub.ready()
    world = 1 + spec.generators
    await asyncio.to_thread(
        weightsync.init_group, plan.weight_group, 1 + plan.worker_index, world, cfg.train.weight_sync_timeout_s
    )
    receiver = weightsync.WeightReceiver(model, shm_slots=weightsync.data_plane(plan.weight_group, model))
    await pub.send(ready_stats(plan))
    inbox = _Inbox()
    listener = asyncio.create_task(_listen(sub, inbox, plan))
    listener.add_done_callback(lambda _: inbox.changed.set())  # wake the worker to see the failure
    try:
        await _work(plan, backend, receiver, tokenizer, task, pub, inbox, listener)
    finally:
        listener.cancel()
        sub.close()
        pub.close()
    return 0


async def _listen(sub: Subscriber, inbox: _Inbox, plan: WorkerPlan) -> None:
    n_gen = plan.model.generators
    while True:
        msg = await sub.recv()
        if isinstance(msg, PromptBatch):
            if msg.batch_id % n_gen == plan.worker_index:
                inbox.batches.append(msg)
        elif isinstance(msg, WeightsReady):
            inbox.announced = max(inbox.announced, msg.version)
        elif isinstance(msg, Control) and msg.command == "stop" and msg.target in ("*", plan.model.name, plan.worker_id):
            inbox.stop = True
        inbox.changed.set()


async def _next_batch(inbox: _Inbox, listener: asyncio.Task) -> PromptBatch | None:
    while not inbox.stop and not inbox.batches:
        if listener.done():
            listener.result()  # re-raise what killed the listener
        inbox.changed.clear()
        await inbox.changed.wait()
    return None if inbox.stop else inbox.batches.popleft()


async def _work(plan, backend, receiver, tokenizer, task, pub, inbox: _Inbox, listener: asyncio.Task) -> None:
    spec = plan.model
    idle = 0.0
    window_start = time.time()
    while True:
        t0 = time.time()
        batch = await _next_batch(inbox, listener)
        if batch is None:
            return
        # Weight swap happens here, between batches, never inside one.
        while inbox.announced > receiver.version or receiver.version < batch.min_weight_version:
            if inbox.announced <= receiver.version:  # sync mode: wait for the learner's announcement
                inbox.changed.clear()
                await inbox.changed.wait()
                if inbox.stop:
                    return
                continue
            await asyncio.to_thread(receiver.receive)
        backend_version = receiver.version
        idle += time.time() - t0
        started = time.time()
        experiences = await asyncio.to_thread(
            _generate, plan, backend, tokenizer, task, batch, backend_version, started
        )
        for exp in experiences:
            await pub.send(exp)
        elapsed = time.time() - started
        tokens = sum(len(e.completion_ids) // 4 for e in experiences)
        window = time.time() - window_start
        await pub.send(Stats(
            schema=SCHEMA_VERSION, worker_id=plan.worker_id, role="generator", model=spec.name,
            time=time.time(), window_s=window, samples_per_s=len(experiences) / max(elapsed, 1e-9),
            tokens_per_s=tokens / max(elapsed, 1e-9), idle_frac=idle / max(window, 1e-9),
            weight_version=backend_version,
        ))
        idle, window_start = 0.0, time.time()


def _generate(plan: WorkerPlan, backend, tokenizer, task, batch: PromptBatch, version: int, started: float) -> list[Experience]:
    spec, train = plan.model, plan.config.train
    problems = [Problem(prompt_id=p.prompt_id, task=p.task, question=p.question, answer=p.answer) for p in batch.problems]
    prompts = [prompt_ids(tokenizer, spec.arch, p.question) for p in problems]
    seed = hash((plan.config.run.seed, plan.model_index, plan.worker_index, batch.batch_id)) & 0x7FFFFFFF
    with torch.no_grad():
        samples = backend.generate(prompts, batch.group_size, train.max_new_tokens, train.temperature, seed=seed)
    done = time.time()
    out = []
    for problem, ids, group in zip(problems, prompts, samples):
        for k, sample in enumerate(group):
            text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
            verdict = task.verify(problem, text)
            out.append(Experience(
                schema=SCHEMA_VERSION, run_id=plan.run_id,
                experience_id=f"{spec.name}/{problem.prompt_id}/{k}/{plan.worker_id}",
                model=spec.name, task=problem.task, prompt_id=problem.prompt_id, sample_index=k,
                group_size=batch.group_size, weight_version=version,
                prompt_ids=pack_ids(ids), completion_ids=pack_ids(sample.completion_ids),
                behaviour_logprobs=pack_floats(sample.logprobs), completion_text=text,
                reward=float(verdict.reward), verified=bool(verdict.verified),
                finish_reason=sample.finish_reason, created_at=started, generated_at=done,
            ))
    return out


def ready_stats(plan: WorkerPlan) -> Stats:
    """The first Stats a worker sends: it is subscribed and in its weight group, so work may flow."""
    return Stats(schema=SCHEMA_VERSION, worker_id=plan.worker_id, role=plan.role, model=plan.model.name,
                 time=time.time(), window_s=0.0)


def _with_checkpoint(spec, checkpoint: str):
    import msgspec

    return msgspec.structs.replace(spec, checkpoint=checkpoint)


def _pad(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
