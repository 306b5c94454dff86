"""MWRA on real processes: the best fixed split vs. MWRA, same wall-clock budget.

    python -m benchmarks.mwra [--quick] [--repeats N] [--static-candidates K] [--plot PATH]

What a worker is: one process standing in for one GPU. Its compute budget is a cost
model (``engine/poolconfig.py``): generating one sample of model m costs ``gen_s[m]``
worker-seconds and training on one ``train_s[m]``; the worker pads each batch with
sleep up to that cost, so its speed does not depend on how busy the 2 CPU cores are
(real compute is a few percent of the budget). Eight workers, two real models (GPT-2
and Llama shapes with real tokenizers) trained with XGRPO through the SEE broker.

Workload: one model is 4x as expensive per sample as the other, and halfway through
the run they swap (response lengths drifting apart during RL, as the paper's runs
show): no fixed split is right for the whole run.

Best fixed split: every split of the workers over the four pools (generator/learner x
model, at least one each) is scored with the cost model (the slowest pool's prompt
rate, averaged over the two phases); every split tied with the best prediction (four here)
is run for real, and the best *measured* one is the baseline (``--static-candidates K``
runs the K best-ranked instead). ``--repeats N`` runs the whole comparison N times; the
ratio pools them. MWRA starts from an even
split and is driven by the live Stats. Both count only samples of prompts that every
model generated AND trained on. The run also checks, against the broker's experience
log, that no experience was lost or duplicated across reassignments.

Last line: JSON with static_samples_per_s, mwra_samples_per_s, ratio (target >= 1.2).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
import json
import sys
import tempfile
from pathlib import Path

import msgspec

CONFIG = "configs/pool.toml"


@dataclass
class Pair:
    """One repeat: the best measured fixed split's run, the MWRA run, every run of the repeat."""

    static: object  # engine.pool.PoolResult
    mwra: object
    runs: list
    static_split: dict[str, int]


def static_splits(workers: int, pools: list[str]) -> list[dict[str, int]]:
    out = []
    for cut in itertools.combinations(range(1, workers), len(pools) - 1):
        sizes = [b - a for a, b in zip((0, *cut), (*cut, workers))]
        out.append(dict(zip(pools, sizes)))
    return out


def predicted_rate(split: dict[str, int], pool, G: int, duration: float) -> float:
    """Prompts/s the cost model predicts for a fixed split: per phase, the slowest pool's rate."""
    edges = sorted({min(p.from_s, duration) for p in pool.phases} | {duration})
    total = 0.0
    for a, b in zip(edges, edges[1:]):
        rates = []
        for key, n in split.items():
            role, model = key.split(":", 1)
            cost = pool.cost("gen" if role == "generator" else "train", model, a)
            rates.append(n / (G * cost) if cost > 0 else float("inf"))
        total += (b - a) * min(rates)
    return total / duration


def run_one(cfg, pool, checkpoints: list[str], label: str, workdir: Path):
    import uvloop

    from engine.pool import PoolRun

    run_dir = workdir / label
    run_dir.mkdir(parents=True)
    print(f"--- {label}: {pool.mode} {dict(pool.static_split) or ''} for {pool.duration_s:g}s", flush=True)
    result = uvloop.run(PoolRun(cfg, pool, run_dir, checkpoints).run())
    print(f"{label}: {result.useful_prompts} useful prompts, {result.useful_samples_per_s:.3f} useful samples/s, "
          f"steps {result.steps}, moves {result.decisions}, re-formations {result.regroups}, "
          f"hand-backs {result.handbacks}, lost {result.audit.lost}, duplicated {result.audit.duplicates}", flush=True)
    return result, run_dir


def plot(result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for row in result.timeline for k in row["counts"]})
    t = [row["t"] for row in result.timeline]
    fig, ax = plt.subplots(figsize=(8, 4))
    for k in keys:
        ax.step(t, [row["counts"].get(k, 0) for row in result.timeline], where="post", label=k)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("workers")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mwra", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 s per run instead of 100 s")
    parser.add_argument("--static-candidates", type=int, default=0, metavar="K",
                        help="run the K fixed splits the cost model ranks best and keep the best measured "
                        "(default: every split tied with the best prediction)")
    parser.add_argument("--repeats", type=int, default=1, help="run the static/MWRA pair this many times; "
                        "the ratio pools all of them, and each pair's ratio is printed too")
    parser.add_argument("--plot", default="benchmarks/figures/mwra_pool_allocations.png")
    args = parser.parse_args(argv)

    from engine.poolconfig import load_pool_run
    from engine.supervisor import prepare_models

    duration = 60.0 if args.quick else 100.0
    cfg, base = load_pool_run(CONFIG, [f"pool.duration_s={duration}"])
    half = duration / 2
    phases = [msgspec.structs.replace(p, from_s=0.0 if p.from_s == 0 else half) for p in base.phases]
    base = msgspec.structs.replace(base, phases=phases, controller={
        "decision_interval_s": 2.0, "cooldown_s": 4.0, "min_dwell_s": 6.0, "ewma_halflife_s": 3.0,
        "min_busy_s": 0.5, "max_move_frac": 0.375})
    G = cfg.train.group_size
    pools = sorted(f"{r}:{m.name}" for r in ("generator", "learner") for m in cfg.models)
    ranked = sorted(static_splits(base.workers, pools), key=lambda s: -predicted_rate(s, base, G, duration))
    for s in ranked[:max(4, args.static_candidates)]:
        print(f"fixed split {s}: predicted {predicted_rate(s, base, G, duration):.3f} prompts/s", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="bench-mwra-"))
    preps = prepare_models(cfg, workdir)
    checkpoints = [p.checkpoint for p in preps]
    top = predicted_rate(ranked[0], base, G, duration)
    tied = sum(predicted_rate(s, base, G, duration) >= 0.99 * top for s in ranked)
    k = args.static_candidates or tied
    runs = [(f"static-{i + 1}" if k > 1 else "static", msgspec.structs.replace(base, mode="static", static_split=split))
            for i, split in enumerate(ranked[:k])]
    runs.append(("mwra", msgspec.structs.replace(base, mode="mwra")))
    split_of = {label: dict(pool.static_split) for label, pool in runs if label.startswith("static")}
    pairs = []
    for rep in range(max(1, args.repeats)):
        suffix = f"-run{rep + 1}" if args.repeats > 1 else ""
        results = {label: run_one(cfg, pool, checkpoints, label + suffix, workdir)[0] for label, pool in runs}
        best = max((label for label in results if label.startswith("static")),
                   key=lambda label: results[label].useful_samples_per_s)
        pairs.append(Pair(results[best], results["mwra"], list(results.values()), split_of[best]))

    static_rate = sum(p.static.useful_samples_per_s for p in pairs) / len(pairs)
    mwra_rate = sum(p.mwra.useful_samples_per_s for p in pairs) / len(pairs)
    mwra = pairs[-1].mwra
    plot(mwra, Path(args.plot), f"MWRA on {base.workers} pool workers (costs swap at {half:g}s)")
    every = [r for p in pairs for r in p.runs]
    lost = sum(r.audit.lost + r.audit.duplicates for r in every)
    digests_equal = all(len(set(f["digests"].values())) == 1 for r in every for f in r.formations)
    out = {
        "static_samples_per_s": round(static_rate, 3),
        "mwra_samples_per_s": round(mwra_rate, 3),
        "ratio": round(mwra_rate / static_rate, 3),
        "ratios": [round(p.mwra.useful_samples_per_s / p.static.useful_samples_per_s, 3) for p in pairs],
        "static_split": [p.static_split for p in pairs],  # the best measured fixed split of each repeat
        "duration_s": duration,
        "workers": base.workers,
        "mwra_moves": mwra.decisions,
        "mwra_regroups": mwra.regroups,
        "handbacks": mwra.handbacks,
        "experience_lost": lost,
        "state_transfers_bit_identical": digests_equal,
        "plot": args.plot,
        "run_dirs": str(workdir),
    }
    print(json.dumps(out))
    return 0 if lost == 0 and digests_equal else 1


if __name__ == "__main__":
    sys.exit(main())
