"""MWRA at cluster scale: the controller vs. the oracle static split, in simulation.

    python -m benchmarks.mwra_sim            # 8, 64 and 512 GPUs, both workloads (a few minutes)
    python -m benchmarks.mwra_sim --quick    # 32 GPUs, shorter run (< 30 s)

Three models (Qwen3-1.7B/4B/8B shapes) train together on H100s; costs and their
sources are in benchmarks/mwra_costs.py, the simulator in benchmarks/mwra_simcore.py.
For each workload (stationary lengths; lengths that grow during training) and
cluster size it runs the same sampled work three ways:

- oracle static, fluid: the best of EVERY static split (benchmarks/mwra_oracle.py,
  exact branch and bound) under a fluid model with perfect pipelining and no switching;
- oracle static, simulated: that split run through the simulator;
- MWRA: engine.controller.decide driving the simulator live from Stats, starting from
  an even split, paying every switch cost.

``oracle_static_throughput`` is the larger of the two static figures, so the ratio is
never flattered by the simulator's pipeline losses. Throughput counts only samples of
prompts that every model generated and trained (complete cross-model groups).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.mwra_costs import MODELS, block_costs
from benchmarks.mwra_oracle import best_static_split, dynamic_run_time
from benchmarks.mwra_simcore import Simulation, SimResult, sim_config
from engine.schedule.allocation import pool_key
from engine.schedule.controller import ControllerConfig, ModelLimits

STATIONARY_MIN_RATIO = 0.9
DRIFTING_MIN_RATIO = 1.2
SEGMENTS = 100  # fluid model resolution along the run
FIGURE = Path("benchmarks/figures/mwra_allocations.png")


def controller_config() -> ControllerConfig:
    return ControllerConfig(models=[ModelLimits(name=m.name, group_size=m.group_size) for m in MODELS])


def pool_keys() -> list[str]:
    return [pool_key(role, m.name) for m in MODELS for role in ("generator", "learner")]


def segment_costs(costs, n_blocks: int) -> np.ndarray:
    """(SEGMENTS, pools) GPU-seconds each pool must spend on each stretch of the run."""
    cols = []
    for key in pool_keys():
        role, model = key.split(":", 1)
        per_block = (costs.gen if role == "generator" else costs.train)[model][:n_blocks]
        cols.append(per_block)
    X = np.stack(cols, axis=1)  # (n_blocks, K)
    edges = np.linspace(0, n_blocks, SEGMENTS + 1).astype(int)
    return np.add.reduceat(X, edges[:-1], axis=0)


def run_case(workload: str, n_workers: int, n_steps: int, seed: int) -> dict:
    cfg = sim_config(n_workers, n_steps)
    n_blocks = n_steps * cfg.train_batch_blocks
    costs = block_costs(workload, n_blocks, cfg.block_prompts, seed)
    C = segment_costs(costs, n_blocks)
    K = C.shape[1]
    t0 = time.perf_counter()
    split, fluid_T, nodes = best_static_split(C, n_workers, np.ones(K, int), np.full(K, n_workers))
    search_s = time.perf_counter() - t0
    counts = dict(zip(pool_keys(), map(int, split)))
    static = Simulation(cfg, costs, static_counts=counts).run()
    mwra = Simulation(cfg, costs, controller=controller_config()).run()
    fluid = static.useful_samples / fluid_T
    oracle = max(fluid, static.throughput)
    return {
        "workload": workload, "gpus": n_workers, "steps": n_steps, "blocks": n_blocks,
        "oracle_split": counts, "oracle_search_nodes": nodes, "oracle_search_s": round(search_s, 2),
        "oracle_static_fluid": fluid, "oracle_static_simulated": static.throughput,
        "oracle_static_throughput": oracle, "mwra_throughput": mwra.throughput,
        "ratio": mwra.throughput / oracle,
        "fluid_dynamic_bound": static.useful_samples / dynamic_run_time(C, n_workers),
        "mwra_moves": mwra.moves, "mwra_decisions": len(mwra.decisions),
        "run_hours_mwra": mwra.run_time_s / 3600, "run_hours_static": static.run_time_s / 3600,
        "_mwra": mwra, "_static_counts": counts,
    }


def plot(case: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mwra: SimResult = case["_mwra"]
    keys = pool_keys()
    times = [t / 3600 for t, _ in mwra.timeline] + [mwra.run_time_s / 3600]
    series = np.array([[c.get(k, 0) for k in keys] for _, c in mwra.timeline] + [[mwra.timeline[-1][1].get(k, 0)
                                                                                   for k in keys]])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, k in enumerate(keys):
        ax.step(times, series[:, i], where="post", color=colors[i * 2 % 20], lw=1.8, label=f"MWRA {k}")
        ax.axhline(case["_static_counts"][k], color=colors[i * 2 % 20], lw=0.9, ls="--")
    ax.set_xlabel("hours into the run (simulated)")
    ax.set_ylabel("GPUs assigned")
    ax.set_title(f"MWRA allocations, {case['workload']} workload, {case['gpus']} GPUs "
                 f"(dashed: oracle static split); throughput ratio {case['ratio']:.2f}")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row(c: dict) -> str:
    return (f"{c['workload']:<10} {c['gpus']:>5} {c['oracle_static_fluid']:>11.1f} {c['oracle_static_simulated']:>11.1f} "
            f"{c['mwra_throughput']:>11.1f} {c['ratio']:>6.3f} {c['fluid_dynamic_bound']:>11.1f} {c['mwra_moves']:>6}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small cluster, shorter run (< 30 s)")
    ap.add_argument("--sizes", type=int, nargs="*", help="cluster sizes in GPUs (8..512)")
    ap.add_argument("--steps", type=int, help="learner steps per model in the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--figure", type=Path, default=FIGURE, help="PNG of MWRA allocations over time")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([32] if args.quick else [8, 64, 512])
    steps = args.steps or 1000
    if any(not 8 <= n <= 512 for n in sizes):
        print("--sizes: each cluster size must be between 8 and 512 GPUs", file=sys.stderr)
        return 2
    headline = 32 if args.quick else (64 if 64 in sizes else sizes[0])
    headline = headline if headline in sizes else sizes[0]
    print(f"{'workload':<10} {'GPUs':>5} {'static.fluid':>11} {'static.sim':>11} {'mwra':>11} {'ratio':>6} "
          f"{'dyn.bound':>11} {'moves':>6}   (useful samples/s)")
    cases = []
    t0 = time.perf_counter()
    for workload in ("stationary", "drifting"):
        for n in sizes:
            case = run_case(workload, n, steps, args.seed)
            cases.append(case)
            print(_row(case), flush=True)
            if workload == "drifting" and n == headline:
                plot(case, args.figure)
    out: dict = {"benchmark": "mwra_sim", "quick": args.quick, "seed": args.seed, "headline_gpus": headline,
                 "figure": str(args.figure), "wall_s": round(time.perf_counter() - t0, 1)}
    for workload, need in (("stationary", STATIONARY_MIN_RATIO), ("drifting", DRIFTING_MIN_RATIO)):
        mine = [c for c in cases if c["workload"] == workload]
        head = next(c for c in mine if c["gpus"] == headline)
        out[workload] = {k: head[k] for k in ("oracle_static_throughput", "mwra_throughput", "ratio",
                                               "oracle_static_fluid", "oracle_static_simulated", "oracle_split",
                                               "mwra_moves")}
        out[workload]["min_ratio_all_sizes"] = min(c["ratio"] for c in mine)
        out[workload]["required"] = need
        out[workload]["passes"] = all(c["ratio"] >= need for c in mine)
        out[workload]["by_size"] = {c["gpus"]: round(c["ratio"], 4) for c in mine}
    out["passes"] = out["stationary"]["passes"] and out["drifting"]["passes"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
