"""Before RL: each model's warm start and its held-out accuracy, both cached on disk.

Runs one process per model (in parallel: the warm starts are independent). The
result for model m is the warm-start checkpoint directory and its evaluation,
written as JSON into that directory so a later run on this machine reuses both.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec

from engine.config import ModelConfig, RunConfig, tokenizer_cache
from engine.evaluation import evaluate
from engine.warmstart import warm_start, warm_start_path
from policies.backend import HFBackend
from policies.models import ModelSpec
from tasks.registry import make_task
from tokenbridge import load_tokenizer


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


def model_spec(m: ModelConfig) -> ModelSpec:
    """The plain ModelSpec of a model entry (worker counts and lr do not change the weights)."""
    return ModelSpec(**{f: getattr(m, f) for f in ModelSpec.__struct_fields__})


def prepare_model(payload: bytes) -> int:
    """Process entry: warm-start one model (cached), evaluate it (cached), write the result."""
    plan = msgspec.msgpack.decode(payload, type=PrepPlan)
    cfg = plan.config
    m = cfg.models[plan.model_index]
    spec = model_spec(m)
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    task = make_task(cfg.task)
    warm_dir = Path(plan.cache_dir) / "warmstart"
    ws = cfg.warmstart if m.warmstart_steps is None else msgspec.structs.replace(cfg.warmstart, steps=m.warmstart_steps)
    model = warm_start(spec, tokenizer, task, ws, warm_dir, progress=plan.progress)
    checkpoint = warm_start_path(spec, tokenizer, task, ws, warm_dir)
    acc, stderr, n = _cached_eval(model, tokenizer, spec, task, cfg, checkpoint)
    result = PrepResult(model=m.name, checkpoint=str(checkpoint), warm_accuracy=acc, warm_accuracy_stderr=stderr, eval_n=n)
    _atomic_write(Path(plan.result_path), msgspec.json.encode(result))
    return 0


def _cached_eval(model, tokenizer, spec, task, cfg: RunConfig, checkpoint: Path) -> tuple[float, float, int]:
    ev = cfg.eval
    key = hashlib.sha256(msgspec.json.encode(
        {"task": cfg.task, "n": ev.num_problems, "t": ev.temperature, "max_new": cfg.train.max_new_tokens}
    )).hexdigest()[:16]
    path = checkpoint / f"eval-{key}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return data["accuracy"], data["stderr"], data["n"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    backend = HFBackend(model.eval(), eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    result = evaluate(backend, tokenizer, spec.arch, task, ev.num_problems, temperature=ev.temperature,
                      batch_size=ev.batch_size, max_new_tokens=cfg.train.max_new_tokens)
    _atomic_write(path, json.dumps({"accuracy": result.accuracy, "stderr": result.stderr, "n": result.n}).encode())
    return result.accuracy, result.stderr, result.n


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
