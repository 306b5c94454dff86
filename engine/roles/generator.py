"""The generator role: pull work units, sample G completions per prompt, publish scored Experience.

Loop invariants:
- A unit is generated with one weight version from start to end: new weights are loaded
  from the model's channel only between units, and before the first one (a generator
  that joins runs the newest published weights, never the warm start's once a step exists).
- The generator never waits for its learner, except when a unit asks for a version the
  channel does not hold yet (sync mode), at most ``timeouts.weights_s``.
- The behaviour log-probs published are those of the distribution sampled from.
"""

from __future__ import annotations

import asyncio
import copy
import time
import zlib

import torch

from engine.roles.memory import trim_heap
from engine.runtime.plane import HandBack, Order, RewardFailed, UnitDone, WantWork, WorkUnit
from engine.train.group import params_digest
from engine.weights.channel import WeightSyncError
from engine.weights.ends import weight_reader
from exchange.protocol import SCHEMA_VERSION, Experience, Stats, pack_floats, pack_ids
from policies.backend import CudaHFBackend, GenerationBackend, HFBackend
from policies.lora import has_adapters, merged
from policies.models import pad_token_id
from policies.sglang_backend import SglangBackend, engine_args, sglang_backend
from policies.templates import end_ids, prompt_format, prompt_ids
from tasks.base import VerifierError
from tasks.rewards import score


async def generate_role(worker, order: Order) -> None:
    model = order.assign.model
    policy = worker.policy(model)
    tok = policy.tokenizer
    worker.reader = reader = weight_reader(worker, model, policy.module)
    worker.reader_model = model
    # an sglang Engine starts in minutes, a static-cache copy in seconds: not on the loop that hears a halt
    worker.backend = backend = await asyncio.to_thread(make_backend, worker, model, policy)
    policy.version = await asyncio.to_thread(reader.load)  # over a pair group it waits on the leader
    await asyncio.to_thread(_push_weights, backend, policy)
    worker.acquired()
    worker.role_now = ("generator", model)
    asked, checked, idle, window_start = False, False, 0.0, time.time()
    try:
        while not worker.inbox.halt and not worker.inbox.newer_order(order):
            if not worker.inbox.work:
                if not asked:
                    await worker.plane.send(WantWork(worker.id, model))
                    asked = True
                t = time.time()
                worker.check_listener()
                await worker.inbox.wait()
                idle += time.time() - t
                continue
            unit, asked = worker.inbox.work.popleft(), False
            started = time.time()  # a unit's budget covers loading the newest weights too
            policy.version = await _weights_for(worker, reader, unit)
            await asyncio.to_thread(_push_weights, backend, policy)
            try:
                exps, timeouts, errors = await asyncio.to_thread(sample_unit, worker, backend, tok, unit,
                                                                 policy.version, started)
            except VerifierError as exc:  # nothing of the unit was published: it goes back, and the run stops
                worker.inbox.work.appendleft(unit)
                await worker.plane.send(RewardFailed(worker.id, model, str(exc)))
                while not worker.inbox.halt and not worker.inbox.newer_order(order):
                    worker.check_listener()
                    await worker.inbox.wait()
                break
            await worker.pad_to_budget("gen", model, started, len(exps))
            for exp in exps:
                await worker.pub.send(exp)
            # "done" means logged: the broker confirms it has the unit before the coordinator hears of it, so a
            # halt right after cannot drop the last samples (the audit checks every done unit against the log)
            await worker.pub.sync(worker.cfg.timeouts.logged_s)
            digest = "" if checked else params_digest(policy.module)
            checked = True
            await worker.plane.send(UnitDone(worker.id, model, unit.prompt_ids, len(exps), policy.version,
                                             time.time() - started, digest, timeouts, len(errors),
                                             errors[0] if errors else ""))
            window = time.time() - window_start
            await worker.pub.send(Stats(
                schema=SCHEMA_VERSION, worker_id=worker.id, role="generator", model=model, time=time.time(),
                window_s=window, samples_per_s=len(exps) / window, idle_frac=idle / window,
                tokens_per_s=sum(len(e.completion_ids) // 4 for e in exps) / window, weight_version=policy.version))
            idle, window_start = 0.0, time.time()
    finally:
        worker.role_now = None
        while worker.inbox.work:  # a started unit is finished above; unstarted ones go back
            await worker.plane.send(HandBack(worker.id, worker.inbox.work.popleft()))


def make_backend(worker, model: str, policy) -> GenerationBackend:
    """The model's ``generation.backend``: transformers sampling from the worker's module, or sglang."""
    g, tok = worker.cfg.model(model).generation, policy.tokenizer
    stops = end_ids(tok, worker.cfg.model(model).end)  # EOS, and a base model's line breaks
    if g.backend == "hf":
        return HFBackend(policy.module, eos_token_id=tok.eos_token_id, pad_token_id=pad_token_id(tok),
                         device=worker.device, stop_ids=stops)
    if g.backend == "hf-static":  # its own copy, cast: the module stays what the channel and the digests read
        backend = CudaHFBackend(copy.deepcopy(policy.module), tok.eos_token_id, pad_token_id(tok), device=worker.device,
                                dtype=getattr(torch, g.dtype), stop_ids=stops)
        backend.version = -1
        return backend
    gpu = worker.device.index or 0
    args = engine_args(g.dtype, worker.cfg.run.seed, gpu, g.sglang_memory / workers_on_gpu(worker.cfg, gpu),
                       g.sglang_deterministic, g.sglang_args)
    return sglang_backend(tok.eos_token_id, g.dtype, g.sglang_url, worker.plan.warm_checkpoints[model], args, stops)


def workers_on_gpu(cfg, gpu: int) -> int:
    """How many of a node's workers share GPU ``gpu`` (round-robin placement: ``worker_device``)."""
    per_node, gpus = cfg.pool.workers_per_node(), max(torch.cuda.device_count(), 1)
    return len(range(gpu, per_node, gpus)) or 1


def _push_weights(backend: GenerationBackend, policy) -> None:
    """HFBackend samples from the module the weight channel fills; a backend holding its own copy (hf-static,
    sglang) is sent each new version from it, between units."""
    if getattr(backend, "model", None) is policy.module:
        backend.version = policy.version
    elif backend.version != policy.version:
        # by parameter, as sglang takes updates: tied weights once, under the name its loader knows; a model with
        # LoRA adapters goes merged to sglang, which holds the plain model (hf-static's copy has the adapters)
        module = merged(policy.module) if isinstance(backend, SglangBackend) and has_adapters(policy.module) \
            else policy.module
        backend.load_state_dict({n: p.detach() for n, p in module.named_parameters()}, policy.version)


async def _weights_for(worker, reader, unit: WorkUnit) -> int:
    """The newest weights, and at least the version the unit asks for (sync mode), within ``weights_s``."""
    deadline = time.time() + worker.cfg.timeouts.weights_s
    while (version := await asyncio.to_thread(reader.load)) < unit.min_weight_version:
        if time.time() > deadline:
            raise WeightSyncError(f"{unit.model}: weight version {unit.min_weight_version} did not arrive within "
                                  f"timeouts.weights_s={worker.cfg.timeouts.weights_s:g}s (held: {version})")
        await asyncio.sleep(0.005)  # the learner publishes before it reports the step, so this is rare
    return version


def sample_unit(worker, backend: GenerationBackend, tok, unit: WorkUnit, version: int,
                started: float) -> tuple[list[Experience], int, list[str]]:
    """G completions for each prompt of ``unit``, verified and scored, as Experience messages; how many of them
    the verifier ran out of time on (judged wrong); and what it raised on, scored 0 (train.reward_errors =
    "zero"; with "stop" the first raise is a VerifierError)."""
    cfg, model = worker.cfg, unit.model
    fmt = prompt_format(cfg.model(model))
    prompts = [prompt_ids(tok, fmt, p.prompt) for p in unit.problems]
    seed = zlib.crc32(f"{cfg.run.seed}/{model}/{worker.id}/{unit.problems[0].prompt_id}".encode())  # stable across processes
    with torch.no_grad():
        samples = backend.generate(prompts, unit.group_size, cfg.train.max_new_tokens, cfg.train.temperature, seed=seed,
                                   top_p=cfg.train.top_p, top_k=cfg.train.top_k)
    if worker.device.type == "cpu":
        trim_heap()  # the unit's KV cache back to the machine while the next unit waits
    done = time.time()
    out, errors, zero = [], [], cfg.train.reward_errors == "zero"
    flat = [(problem, ids, k, sample) for problem, ids, group in zip(unit.problems, prompts, samples)
            for k, sample in enumerate(group)]
    texts = [tok.decode(sample.completion_ids, skip_special_tokens=True) for *_, sample in flat]
    verdicts = score(worker.task, [problem for problem, *_ in flat], texts, errors if zero else None,
                     [sample.completion_ids for *_, sample in flat])  # a batch, as TRL's reward functions take
    timeouts = sum(v.timed_out for v in verdicts)
    for (problem, ids, k, sample), text, verdict in zip(flat, texts, verdicts):
        out.append(Experience(
            schema=SCHEMA_VERSION, run_id=worker.plan.run_id,
            experience_id=f"{model}/{problem.prompt_id}/{k}/{worker.id}",
            model=model, task=problem.task, prompt_id=problem.prompt_id, sample_index=k,
            group_size=unit.group_size, weight_version=version,
            prompt_ids=pack_ids(ids), completion_ids=pack_ids(sample.completion_ids),
            behaviour_logprobs=pack_floats(sample.logprobs), completion_text=text,
            reward=float(verdict.reward), verified=bool(verdict.verified),
            finish_reason=sample.finish_reason, created_at=started, generated_at=done,
            reward_parts=list(verdict.parts),
        ))
    return out, timeouts, errors

