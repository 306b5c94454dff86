"""MWRA on real processes: the best fixed split vs. MWRA, same wall-clock budget, one engine.

    python -m benchmarks.mwra [--quick] [--repeats N] [--static-candidates K] [--out DIR] [--update-readme-figure]

Every run is the engine's ordinary run (``engine.coordinator``) of configs/pool.toml; only
``pool.allocator`` (and the static split) differ. What a worker is: one process standing in
for one GPU. Its compute budget is a cost model (``pool.costs``): generating one sample of model m costs ``gen_s[m]``
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

The allocation plot goes to the output directory (``--out``, default a temporary one);
``--update-readme-figure`` also writes README's benchmarks/figures/mwra_pool_allocations.png.

Last line: JSON with static_samples_per_s, mwra_samples_per_s, ratio (target >= 1.3).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
import json
import sys
import tempfile
from pathlib import Path

CONFIG = "configs/pool.toml"
README_FIGURE = "benchmarks/figures/mwra_pool_allocations.png"
TARGET = 1.3


@dataclass
class Pair:
    """One repeat: the best measured fixed split's run, the MWRA run, every run of the repeat."""

    static: object  # engine.coordinator.RunResult
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
    edges = sorted({min(p.from_s, duration) for p in pool.costs} | {duration})
    total = 0.0
    for a, b in zip(edges, edges[1:]):
        rates = []
        for key, n in split.items():
            role, model = key.split(":", 1)
            cost = pool.cost("gen" if role == "generator" else "train", model, a)
            rates.append(n / (G * cost) if cost > 0 else float("inf"))
        total += (b - a) * min(rates)
    return total / duration


def run_one(cfg, label: str, workdir: Path):
    from engine.session import run_config

    pool = cfg.pool
    print(f"--- {label}: {pool.allocator} {dict(pool.split) or ''} for {cfg.run.max_minutes * 60:g}s", flush=True)
    code, result = run_config(cfg, workdir / label)
    if result is None:
        raise SystemExit(f"error: the {label} run failed (exit code {code}); see {workdir / label}")
    print(f"{label}: {result.useful_prompts} useful prompts, {result.useful_samples_per_s:.3f} useful samples/s, "
          f"steps {result.steps}, moves {result.moves}, re-formations {result.regroups}, "
          f"hand-backs {result.handbacks}, lost {result.audit.lost}, duplicated {result.audit.duplicates}", flush=True)
    return result


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
    parser.add_argument("--out", default=None, help="where the runs and the plot go (default: a temporary directory)")
    parser.add_argument("--update-readme-figure", action="store_true", help=f"also write {README_FIGURE}")
    args = parser.parse_args(argv)

    from engine.config import load_run_config

    duration = 60.0 if args.quick else 100.0
    half = duration / 2
    controller = ("{decision_interval_s = 2.0, cooldown_s = 4.0, min_dwell_s = 6.0, ewma_halflife_s = 3.0, "
                  "min_busy_s = 0.5, max_move_frac = 0.375}")
    base_sets = [f"run.max_minutes={duration / 60}", "pool.costs.1.from_s=" + f"{half}", "eval.num_problems=20",
                 f"pool.controller={controller}"]
    cfg = load_run_config(CONFIG, base_sets)
    G = cfg.train.group_size
    pools = sorted(f"{r}:{m}" for r in ("generator", "learner") for m in cfg.names)
    ranked = sorted(static_splits(cfg.pool.workers, pools), key=lambda s: -predicted_rate(s, cfg.pool, G, duration))
    for s in ranked[:max(4, args.static_candidates)]:
        print(f"fixed split {s}: predicted {predicted_rate(s, cfg.pool, G, duration):.3f} prompts/s", flush=True)
    top = predicted_rate(ranked[0], cfg.pool, G, duration)
    tied = sum(predicted_rate(s, cfg.pool, G, duration) >= 0.99 * top for s in ranked)
    k = args.static_candidates or tied

    def split_sets(split: dict[str, int]) -> list[str]:
        return ["pool.allocator=static", "pool.split={" + ", ".join(f"'{p}' = {n}" for p, n in split.items()) + "}"]

    runs = [(f"static-{i + 1}" if k > 1 else "static", load_run_config(CONFIG, base_sets + split_sets(split)))
            for i, split in enumerate(ranked[:k])]
    runs.append(("mwra", cfg))
    workdir = Path(args.out or tempfile.mkdtemp(prefix="bench-mwra-"))
    pairs = []
    for rep in range(max(1, args.repeats)):
        suffix = f"-run{rep + 1}" if args.repeats > 1 else ""
        results = {label: run_one(c, label + suffix, workdir) for label, c in runs}
        best = max((label for label in results if label.startswith("static")),
                   key=lambda label: results[label].useful_samples_per_s)
        split = dict(next(c for label, c in runs if label == best).pool.split)
        pairs.append(Pair(results[best], results["mwra"], list(results.values()), split))

    static_rate = sum(p.static.useful_samples_per_s for p in pairs) / len(pairs)
    mwra_rate = sum(p.mwra.useful_samples_per_s for p in pairs) / len(pairs)
    mwra = pairs[-1].mwra
    title = f"MWRA on {cfg.pool.workers} workers (costs swap at {half:g}s)"
    plots = [workdir / "mwra_pool_allocations.png"] + ([Path(README_FIGURE)] if args.update_readme_figure else [])
    for path in plots:
        plot(mwra, path, title)
    every = [r for p in pairs for r in p.runs]
    lost = sum(r.audit.lost + r.audit.duplicates for r in every)
    digests_equal = all(len(set(f["digests"].values())) == 1 for r in every for f in r.formations)
    ratio = mwra_rate / static_rate
    out = {
        "static_samples_per_s": round(static_rate, 3),
        "mwra_samples_per_s": round(mwra_rate, 3),
        "ratio": round(ratio, 3),
        "ratios": [round(p.mwra.useful_samples_per_s / p.static.useful_samples_per_s, 3) for p in pairs],
        "target": TARGET,
        "static_split": [p.static_split for p in pairs],  # the best measured fixed split of each repeat
        "duration_s": duration,
        "workers": cfg.pool.workers,
        "mwra_moves": mwra.moves,
        "mwra_regroups": mwra.regroups,
        "handbacks": mwra.handbacks,
        "experience_lost": lost,
        "state_transfers_bit_identical": digests_equal,
        "plot": str(plots[-1]),
        "run_dirs": str(workdir),
    }
    print(json.dumps(out))
    return 0 if lost == 0 and digests_equal and ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
