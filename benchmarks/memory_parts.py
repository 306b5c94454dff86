"""The components of a run's memory for ``benchmarks.memory``, each measured in a fresh Python (``python -m
benchmarks.memory --child KIND ARG``, its JSON on its last line): the runtime (imports, a fork's copies), and per
model its weights, its LM head's logits, one generation unit, one evaluation batch, a learner step and a checkpoint
save, each as the rise of the process's resident high-water mark (``VmHWM``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.smaps import own_memory

ROOT = Path(__file__).resolve().parents[1]
# The torch and transformers every process of a run imports (transformers is lazy: its model classes load on use)
RUNTIME_MODULES = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama")


def runtime_child(modules: list[str]) -> dict:
    """This process's memory after importing ``modules`` (a fresh Python: the runtime every process pays)."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    return own_memory()


def task_child(config_path: str) -> dict:
    """A fresh Python with an actor's imports and the run's task made (a generator scores with it; its imports
    are not the fork server's): its memory."""
    from engine.config import load_run_config
    from tasks.registry import make_task

    runtime_child(actor_modules())
    make_task(load_run_config(config_path).task).problem(0)
    return own_memory()


def fork_child(freeze: str) -> dict:
    """What a fork of a server that imported an actor's modules copies of them by collecting garbage once: the
    fork's memory after ``gc.collect()`` (each object the collector visits has its header written, so its page is
    copied). With ``freeze`` ("1"), the server ran ``gc.freeze()`` before forking: the collector leaves its objects
    alone."""
    import gc

    runtime_child(actor_modules())
    if freeze == "1":
        gc.freeze()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        gc.collect()
        os.write(write, json.dumps(own_memory()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


def actor_modules() -> list[str]:
    """What the fork server preloads for every actor (engine.runtime.actors' list), read from multiprocessing."""
    import importlib
    from multiprocessing import forkserver

    importlib.import_module("engine.runtime.actors")  # sets the preload list

    return list(forkserver._forkserver._preload_modules)


def hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def reset_hwm() -> int:
    """Trim the C heap (freed pages back to the OS), reset the high-water mark to the resident size, return it."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one
    return hwm()


@dataclass
class Saved:
    """Bytes of distinct tensors autograd saves for the backward pass (weights excluded), those of vocabulary
    width (logits and their log-softmax) apart."""

    vocab: int
    skip: set[int]
    logits: int = 0
    other: int = 0
    seen: set[int] = field(default_factory=set)

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            size = t.untyped_storage().nbytes()
            if t.dim() and t.shape[-1] == self.vocab:
                self.logits += size
            else:
                self.other += size
        return t


def kv_cache_bytes(config, tokens: int) -> int:
    """Keys and values of ``tokens`` positions over every layer, float32."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4 * tokens


def components_child(config_path: str) -> dict:
    """Per model of the run: its weights, one generation unit, one evaluation batch and one learner step, measured
    in this process (the run's shapes and objective), each as the rise of its resident high-water mark."""
    import torch

    from engine.config import load_run_config

    cfg = load_run_config(config_path)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    out: dict = {"runtime_before_models": own_memory(), "models": {}}
    for m in cfg.models:
        out["models"][m.name] = _model_parts(cfg, m)
    return out


def _model_parts(cfg, m) -> dict:
    import torch

    from engine.config import model_spec, tokenizer_cache
    from engine.roles.memory import held_bytes
    from policies.backend import HFBackend
    from policies.models import build_policy, pad_token_id
    from policies.templates import prompt_ids
    from tasks.registry import make_task
    from tokenbridge import load_tokenizer

    t = cfg.train
    tok = load_tokenizer(m.tokenizer, tokenizer_cache(cfg))
    task = make_task(cfg.task)
    count = max(t.prompts_per_step, cfg.eval.batch_size)
    prompts = [prompt_ids(tok, m.arch, task.problem(i).prompt) for i in range(count)]
    base = reset_hwm()
    module = build_policy(model_spec(m), tok)
    with torch.no_grad():  # a checkpoint's weights are mapped, resident once read: read them all, as a run does
        for param in module.parameters():
            param.sum()
    out = {"weights": {"params": sum(p.numel() for p in module.parameters()), "bytes": held_bytes(module),
                       "rss_rise": reset_hwm() - base}}
    out["logits"] = _logits(module, t.prompts_per_step * t.group_size * t.max_new_tokens)
    backend = HFBackend(module, eos_token_id=tok.eos_token_id, pad_token_id=pad_token_id(tok))
    out["generation_unit"] = _generate(backend, module, [prompts[0]], t.group_size, t.max_new_tokens, t.temperature)
    out["eval_batch"] = _generate(backend, module, prompts[: cfg.eval.batch_size], 1, t.max_new_tokens, 0.0)
    out["learner_step"] = _learner_steps(cfg, m, module, tok, prompts[: t.prompts_per_step])
    del module, backend
    reset_hwm()
    return out


def _generate(backend, module, prompts, samples: int, new_tokens: int, temperature: float) -> dict:
    base = reset_hwm()
    started = time.time()
    done = backend.generate(prompts, samples, new_tokens, temperature, seed=0)
    lengths = [len(p) for p in prompts]
    return {"prompts": len(prompts), "samples": samples, "max_new_tokens": new_tokens,
            "completion_tokens": sum(len(s.completion_ids) for g in done for s in g),
            "peak_rise": hwm() - base, "seconds": round(time.time() - started, 1),
            "kv_cache_at_cap": kv_cache_bytes(module.config, sum((n + new_tokens) * samples for n in lengths))}


def _learner_steps(cfg, m, module, tok, prompts) -> dict:
    """Two steps of the learner's code path on samples of the run's shape, every completion at the cap (the worst
    case: the run's are shorter when they stop at EOS). The first makes the gradients and AdamW moments; the
    second's peak above them is a step's working set."""
    import numpy as np
    import torch

    from engine.train import group as dp
    from engine.train.batching import OwnSample
    from engine.train.optim import adamw
    from engine.train.step import train_share
    from policies.models import pad_token_id

    t = cfg.train
    rng = np.random.default_rng(0)
    vocab = module.get_output_embeddings().weight.shape[0]
    own = [OwnSample(np.asarray(p, dtype=np.int64), rng.integers(0, vocab, t.max_new_tokens, dtype=np.int64),
                     np.full(t.max_new_tokens, -2.0, dtype=np.float32), float(k % 2), bool(k % 2), 0, g)
           for g, p in enumerate(prompts) for k in range(t.group_size)]  # half right: every group has an advantage
    params = [p for p in module.parameters() if p.requires_grad]
    state = dp.TrainState(module, adamw(params, lr=m.lr or t.lr, betas=t.adam_betas),
                          torch.Generator().manual_seed(0))
    module.train()
    data = dp.StepData(prompts=list(range(len(prompts))), own=own, peers=[], peer_version={}, peer_misses=0)
    pad = pad_token_id(tok)
    step = lambda: train_share(state, data, own, [], 0, 1, cfg.objective, pad, t.grad_clip, 1e-9)  # noqa: E731
    base = reset_hwm()
    step()
    first_peak = hwm() - base
    steady = reset_hwm()
    moments = sum(v.untyped_storage().nbytes() for st in state.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor))
    saved = Saved(vocab, {p.untyped_storage().data_ptr() for p in module.parameters()})
    started = time.time()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        step()
    out = {"samples": len(own), "completion_tokens": len(own) * t.max_new_tokens, "vocab": vocab,
           "seconds": round(time.time() - started, 1), "first_step_peak_rise": first_peak,
           "grads_and_adamw_rss_rise": steady - base, "optimizer_state_bytes": moments,
           "peak_above_steady": hwm() - steady, "saved_for_backward": saved.other,
           "saved_logits": saved.logits}
    out["checkpoint_save_peak_rise"] = _checkpoint_save(m.name, state, module, tok)
    state = None  # frees it, as ``del`` would (step's closure holds the name: pyflakes misreads a del)
    return out


def _checkpoint_save(name: str, state, module, tok) -> int:
    """A learner's checkpoint (``engine.train.checkpoint.save``: weights, AdamW state, RNG) of this state, written
    once: the rise of the resident high-water mark while it is written."""
    from types import SimpleNamespace

    from engine.train.checkpoint import save

    core = SimpleNamespace(model_name=name, state=state, module=module, tok=tok, totals={},
                           ingest=SimpleNamespace(consumed=set()))  # what save reads of a LearnerCore
    with tempfile.TemporaryDirectory(prefix="memory-checkpoint-") as tmp:
        base = reset_hwm()
        save(tmp, core, keep=1)
        return hwm() - base


def _logits(module, positions: int) -> dict:
    """The LM head and log-softmax at a learner step's completion positions, forward and backward, alone: as the
    project computes them, and as one (positions x vocabulary) float32 matrix."""
    from policies.logprobs import head_logprobs

    vocab = module.get_output_embeddings().weight.shape[0]
    return {"positions": positions, "vocab": vocab, "one_matrix_bytes": positions * vocab * 4,
            "peak_rise": _head_alone(module, positions, vocab, head_logprobs),
            "peak_rise_one_matrix": _head_alone(module, positions, vocab, one_matrix_logprobs)}


def one_matrix_logprobs(model, hidden, targets):
    """``policies.logprobs.head_logprobs`` as one (N, V) float32 matrix, as it was before it ran in blocks: what
    the chunked head saves is measured against it."""
    import torch

    logits = model.get_output_embeddings()(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _head_alone(module, positions: int, vocab: int, head) -> int:
    """``head`` (the LM head and log-softmax) at a step's completion positions, forward and backward, alone (its
    weights frozen, so no gradient of theirs counts): the logits' share of a step's peak."""
    import torch

    weight = module.get_output_embeddings().weight
    hidden = torch.randn(positions, weight.shape[1], requires_grad=True)
    targets = torch.randint(0, vocab, (positions,))
    weight.requires_grad_(False)
    try:
        before = reset_hwm()
        head(module, hidden, targets).sum().backward()
        return hwm() - before - hidden.numel() * 4  # less the hidden states' gradient
    finally:
        weight.requires_grad_(True)


def in_child(kind: str, arg: str) -> dict:
    """Run ``--child KIND ARG`` in a fresh Python; its last line is its JSON."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--child", kind, arg], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory: the {kind} measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_runtime(config: Path) -> dict:
    """Fresh Pythons: bare; with torch and transformers; with everything an actor imports (the fork server's);
    with that and the run's task."""
    return {"python": in_child("runtime", ""), "torch_transformers": in_child("runtime", ",".join(RUNTIME_MODULES)),
            "actor_imports": in_child("runtime", ",".join(actor_modules())),
            "actor_and_task": in_child("task", str(config)),
            "fork_after_gc": in_child("fork", "0"), "fork_after_gc_frozen": in_child("fork", "1")}


def child_main(kind: str, arg: str) -> int:
    """``--child KIND ARG``: one measurement in this fresh process; its JSON on the last line."""
    run = {"runtime": lambda a: runtime_child([m for m in a.split(",") if m]), "task": task_child,
           "fork": fork_child, "components": components_child}[kind]
    print(json.dumps(run(arg)))
    return 0
