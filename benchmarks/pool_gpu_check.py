"""Role switches on a GPU: a switch gives device memory back before it takes the new role's.

    python -m benchmarks.pool_gpu_check [--device cuda|cpu] [--steps 40] [--run-dir DIR]

A check, not a timing: one short run of configs/pool.toml with ``pool.device = "cuda"`` (4
workers, each a GPU, round robin when there are fewer), static split 1/1/1/1 (w0 generates
gpt2, w1 llama, w2 and w3 lead the gpt2 and llama learner groups), and scripted moves, each
fired when llama's learner reaches a step, that give one worker generator -> learner ->
generator and learner -> generator -> learner, within a model and across models (five switches):

    step 3   w0 generator gpt2 -> learner gpt2    (module reused)   w1 generator llama -> generator gpt2
    step 6   w0 learner gpt2 -> generator llama   (learner state and module dropped)
    step 9   w0 generator llama -> learner llama  (joins w3's group, receives its state)
    step 12  w0 learner llama -> generator llama  (learner state dropped, module reused)

The objective is SGT, so the learners run the rescue sampling with their CPU RNG next to
device tensors. The last line is one JSON object: per switch the CUDA allocator's bytes
before, after the release and after the new role took its memory; ``release_ok`` (every
switch that drops state has after_release < before), ``acquire_ok``, ``released_alive``,
the experience audit, whether every learner formation's ranks hold bit-identical state
and whether generators ran the published weights bit for bit; ``ok`` if all hold. Without
CUDA it prints ``{"skipped": "no CUDA device"}`` and exits 0. ``--device cpu`` runs the
same check on CPU (the release test then reads ``held_bytes``), which is how this script
itself was tested on a box without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from exchange.records import read_records

MOVES = [(3, "w0", "learner", "gpt2"), (3, "w1", "generator", "gpt2"), (6, "w0", "generator", "llama"),
         (9, "w0", "learner", "llama"), (12, "w0", "generator", "llama")]


def _configure(device: str, steps: int):
    from engine.config import load_run_config

    moves = ", ".join(f"{{step_of = 'llama', at_step = {k}, worker = '{w}', role = '{r}', model = '{m}'}}"
                      for k, w, r, m in MOVES)
    return load_run_config("configs/pool.toml", [
        "pool.workers=4", f"train.steps={steps}", "pool.allocator=static", f"pool.device={device}",
        "pool.split={'generator:gpt2' = 1, 'generator:llama' = 1, 'learner:gpt2' = 1, 'learner:llama' = 1}",
        "pool.costs=[{from_s = 0.0, gen_s = {gpt2 = 0.05, llama = 0.05}, train_s = {gpt2 = 0.02, llama = 0.02}}]",
        "objective.kind=sgt", "timeouts.peer_wait_s=1.0",  # a model without generators holds its peer back <= 1 s
        "run.max_minutes=5", "eval.num_problems=20", f"pool.script=[{moves}]"])


def _switch(r: dict, measure: str) -> dict:
    """One role_switch line, reduced to what the check reads."""
    drops = r["from_role"] == "learner" or r["from_model"] != r["to_model"]  # gradients, moments or a module go
    grows = r["to_role"] == "learner" or not r["reused"]  # moments or a module come; else the kept module serves
    before, released, acquired = (r[f"{measure}_{k}"] for k in ("before", "after_release", "after_acquire"))
    return {"worker": r["worker"], "switch": f"{r['from_role']}:{r['from_model']}->{r['to_role']}:{r['to_model']}",
            "reused": r["reused"], "drops_state": drops, "released_alive": r["released_alive"],
            **{f"device_bytes_{k}": r[f"device_bytes_{k}"] for k in ("before", "after_release", "after_acquire")},
            **{f"held_bytes_{k}": r[f"held_bytes_{k}"] for k in ("before", "after_release", "after_acquire")},
            "released": None if before is None else (released < before if drops else released <= before),
            "acquired": None if acquired is None else (acquired > released if grows else acquired >= released)}


def summarize(records: list[dict], result, device: str) -> dict:
    measure = "device_bytes" if device == "cuda" else "held_bytes"
    switches = [_switch(r, measure) for r in records if r.get("event") == "role_switch"]
    published = {(r["model"], r["weight_version"]): r["params_digest"] for r in records if r.get("event") == "step"}
    used = [r for r in records if r.get("event") == "generator_weights" and r["weight_version"] > 0]
    out = {
        "device": device, "gpus": torch.cuda.device_count() if device == "cuda" else 0, "measured_by": measure,
        "switches_expected": len(MOVES), "switches_seen": len(switches), "switches": switches,
        "release_ok": bool(switches) and all(s["released"] is True for s in switches),
        "acquire_ok": bool(switches) and all(s["acquired"] is True for s in switches),
        "released_alive": sum(s["released_alive"] for s in switches),
        "audit_logged": result.audit.logged, "audit_lost": result.audit.lost,
        "audit_duplicates": result.audit.duplicates,
        "formations": len(result.formations),
        "digests_equal": all(len(set(f["digests"].values())) == 1 for f in result.formations),
        "generator_weights_checked": len(used),
        "generator_weights_match": all(published.get((r["gen_model"], r["weight_version"])) == r["params_digest"]
                                       for r in used),
        "steps": result.steps,
    }
    out["ok"] = (out["switches_seen"] == len(MOVES) and out["release_ok"] and out["acquire_ok"]
                 and out["released_alive"] == 0 and result.audit.ok and out["digests_equal"]
                 and out["generator_weights_match"] and min(result.steps.values()) > 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pool_gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=16, help="learner steps per model")
    parser.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0

    from engine.session import run_config

    cfg = _configure(args.device, args.steps)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pool-gpu-check-") as tmp:
        run_dir = Path(args.run_dir or tmp) / "run"
        code, result = run_config(cfg, run_dir)
        if result is None:
            print(json.dumps({"ok": False, "exit_code": code}))
            return 1
        records = read_records(run_dir).records
    out = summarize(records, result, args.device)
    out["wall_s"] = round(time.time() - started, 1)  # warm start (cached after the first run) + the pool run
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
