"""Before RL: each model's warm start and its held-out accuracy, both cached on disk.

One process per model, in parallel (the warm starts are independent). The result for
model m is the warm-start checkpoint directory and its evaluation, written as JSON into
that directory so a later run on this machine reuses both.

``prepare_all`` runs in the coordinator, which never imports torch or transformers (the launcher's
CPU per run); ``prepare_model`` runs in the children, forked from the actor server that has them loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import msgspec

from engine.config import RunConfig, cache_root, model_spec, tokenizer_cache
from tasks.base import task_identity
from engine.runtime import actors


class PrepFailed(RuntimeError):
    """A model's warm start could not be made; the message says which."""


class PrepPlan(msgspec.Struct, frozen=True):
    config: RunConfig
    model_index: int
    cache_dir: str
    result_path: str  # where the child writes its PrepResult
    progress: bool = True


class PrepResult(msgspec.Struct, frozen=True):
    model: str
    checkpoint: str
    warm_accuracy: float
    warm_accuracy_stderr: float
    eval_n: int
    vocab_size: int  # the tokenizer's: the coordinator's audit checks token ids against it without loading it
    warm_start_end: str = ""  # how the warm start ended (engine.prep.warmstart.why_it_stopped), or "loaded from cache"
    # share of its held-out completions cut at the eval length (EvalResult.truncated); None: read from an eval
    # cache written before the cut was counted
    warm_truncated: float | None = None


async def prepare_all(cfg: RunConfig, run_dir: Path, running: list[actors.Actor]) -> list[PrepResult]:
    """Warm-start and evaluate every model in parallel; ``running`` holds the processes while they run
    (so a signal handler can stop them)."""
    cache = cache_root(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, m in enumerate(cfg.models):
        path = run_dir / f".prep-{m.name}.json"
        plan = PrepPlan(config=cfg, model_index=i, cache_dir=str(cache), result_path=str(path),
                        progress=sys.stderr.isatty())
        running.append(actors.spawn(f"prep-{m.name}", "engine.prep.prepare:prepare_model",
                                    msgspec.msgpack.encode(plan), threads=cfg.pool.threads_per_worker))
        paths.append(path)
    print(f"warm start + held-out eval of {len(paths)} models (cached under {cache} after the first run) ...",
          flush=True)
    mine = list(running)
    await asyncio.gather(*(asyncio.to_thread(a.process.join) for a in mine))
    said = {m.name: _take(path.with_suffix(".error")) for m, path in zip(cfg.models, paths)}
    if stopped := [f"the warm start of {name} stopped: {text}" for name, text in said.items() if text]:
        raise PrepFailed(stopped[0])
    results = []
    for m, path, actor in zip(cfg.models, paths, mine):
        if actor.exitcode != 0 or not path.exists():
            raise PrepFailed(f"the warm start of {m.name} failed (exit code {actor.exitcode}); see the messages above")
        results.append(msgspec.json.decode(path.read_bytes(), type=PrepResult))
        path.unlink()
        print(f"warm start {m.name}: {results[-1].warm_start_end}", flush=True)  # stop_accuracy is a goal: met or not
    running.clear()
    return results


def warm_start_steps(cfg: RunConfig, model_index: int) -> int:
    """A model's warm-start length: its own ``warmstart_steps``, else ``warmstart.steps`` for a model built from
    scratch and 0 for a loaded checkpoint (RL starts from the user's weights unless the config asks otherwise)."""
    m = cfg.models[model_index]
    if m.warmstart_steps is not None:
        return m.warmstart_steps
    return 0 if m.checkpoint is not None else cfg.warmstart.steps


def _take(path: Path) -> str | None:
    """A file's text, the file removed; None where there is none."""
    if not path.exists():
        return None
    text = path.read_text()
    path.unlink()
    return text


def prepare_model(payload: bytes) -> int:
    """Process entry: warm-start one model (cached), evaluate it (cached), write the result."""
    from engine.prep.warmstart import warm_start_and_end, warm_start_path
    from policies.templates import prompt_format
    from tasks.base import VerifierError
    from engine.config import run_task
    from tokenbridge import load_tokenizer

    plan = msgspec.msgpack.decode(payload, type=PrepPlan)
    cfg = plan.config
    m = cfg.models[plan.model_index]
    spec = model_spec(m)
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    task = run_task(cfg)
    warm_dir = Path(plan.cache_dir) / "warmstart"
    ws = msgspec.structs.replace(cfg.warmstart, steps=warm_start_steps(cfg, plan.model_index))
    try:
        model, ended = warm_start_and_end(spec, tokenizer, task, ws, warm_dir, progress=plan.progress,
                                          device=prep_device(cfg, plan.model_index))
        checkpoint = warm_start_path(spec, tokenizer, task, ws, warm_dir)
        ev = _cached_eval(model, tokenizer, prompt_format(m), task, cfg, checkpoint, m.name)
    except VerifierError as exc:  # the user's reward function: one line for the launcher, not a traceback
        _atomic_write(Path(plan.result_path).with_suffix(".error"), str(exc).encode())
        return 1
    result = PrepResult(model=m.name, checkpoint=str(checkpoint), warm_accuracy=ev["accuracy"],
                        warm_accuracy_stderr=ev["stderr"], eval_n=ev["n"], vocab_size=len(tokenizer),
                        warm_start_end=ended, warm_truncated=ev.get("truncated"))
    _atomic_write(Path(plan.result_path), msgspec.json.encode(result))
    return 0


def prep_device(cfg: RunConfig, model_index: int):
    """Where a model's warm start and held-out evaluation run: its own GPU where the run has GPUs (TF32 on: a
    real checkpoint's 500-problem evaluation takes hours on a CPU), else the CPU."""
    import torch

    if cfg.pool.device != "cuda":
        return torch.device("cpu")
    torch.set_float32_matmul_precision("high")
    return torch.device("cuda", model_index % torch.cuda.device_count())


def _cached_eval(model, tokenizer, fmt, task, cfg: RunConfig, checkpoint: Path, name: str) -> dict:
    """The warm start's held-out evaluation: accuracy, stderr, n and truncated (absent from a file written before
    the cut was counted: still read, the cut then unknown)."""
    from engine.prep.evaluation import held_out_accuracy
    from policies.templates import as_format

    fmt, ev = as_format(fmt), cfg.eval  # a family's name, or a model's prompt format
    # "max_new" is the length the evaluation decodes: with eval.max_new_tokens = 0 it is the training length,
    # as before that key existed, so the caches written then still answer
    # (and "distinct": scored over distinct held-out questions; a cache from before, with a small task's
    # questions repeated up to n, is not read)
    fields = {"task": task_identity(task), "n": ev.num_problems, "t": ev.temperature,
              "max_new": cfg.eval_max_new_tokens, "distinct": True}
    if fmt.template or fmt.end != "eos":  # a model's own prompt or end: keyed, so the caches written before still answer
        fields["format"] = [fmt.template, fmt.end]
    key = hashlib.sha256(msgspec.json.encode(fields)).hexdigest()[:16]
    path = checkpoint / f"eval-{key}.json"
    if path.exists():
        data = json.loads(path.read_text())
    else:
        result = held_out_accuracy(model, tokenizer, fmt, task, ev.num_problems, ev, cfg.eval_max_new_tokens,
                                   label=f"{name} after the warm start (held-out)",
                                   reward_errors=cfg.train.reward_errors)
        data = {"accuracy": result.accuracy, "stderr": result.stderr, "n": result.n, "truncated": result.truncated}
        _atomic_write(path, json.dumps(data).encode())
    if data["n"] < ev.num_problems:
        print(f"{name}: the task has {data['n']} distinct held-out problems, fewer than eval.num_problems="
              f"{ev.num_problems}; each is scored once", file=sys.stderr, flush=True)
    return data


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def record_warm_starts(metrics, preps: list[PrepResult]) -> None:
    """One ``warm_start`` line a model in metrics.jsonl: the run dir keeps what the launcher printed (stop_accuracy
    met, its step cap, or the cache) and the accuracy RL starts from."""
    for p in preps:
        metrics.write(event="warm_start", model=p.model, ended=p.warm_start_end, checkpoint=p.checkpoint,
                      accuracy=p.warm_accuracy, accuracy_stderr=p.warm_accuracy_stderr, eval_n=p.eval_n,
                      truncated=p.warm_truncated)
