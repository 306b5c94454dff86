"""Contextual-bandit analysis of GRPO, XGRPO, PRP and SGT (the paper's stability-support trade-off).

    python -m benchmarks.bandit [--out runs/bandit/bandit.png] [--quick]

Prints a table, writes a PNG (learning curves + variance / support bars) and, as its last
line, one JSON object with per-method grad_norm, grad_variance, support_gain and
final_success, plus the ratios behind the three qualitative facts, each measured against
the other methods in the same run. "prp" is PRP with the raw density ratio; prp_cN rows
truncate it at c = N (the objective's default is c = 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.bandit_model import METHODS, ProbeReport, analyse, paper_bandit

COLUMNS = [
    ("grad_norm", "|E u|"),
    ("grad_variance", "Var u"),
    ("w_var", "Var w"),
    ("support_gain", "gain(rare)"),
    ("support_gain_never", "gain(never)"),
    ("residual_bias", "THL bias"),
    ("truncation_bias", "trunc bias"),
    ("final_success", "final succ"),
    ("rescue_success", "rescue succ"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bandit", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bandit/bandit.png"), help="PNG path for the plot")
    parser.add_argument("--steps", type=int, default=200, help="updates per learning curve")
    parser.add_argument("--lr", type=float, default=1.0, help="step size on the logits")
    parser.add_argument("--replicas", type=int, default=32, help="independent learners averaged per curve")
    parser.add_argument("--residual", type=float, default=0.3, help="std of the THL log-prob residual PRP sees")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="shorter curves (80 steps, 16 replicas)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.replicas = 80, 16
    for name in ("steps", "replicas"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def format_table(reports: dict[str, ProbeReport]) -> str:
    head = f"{'method':9s}" + "".join(f"{label:>13s}" for _, label in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, rep in reports.items():
        lines.append(f"{name:9s}" + "".join(f"{getattr(rep, key):13.4g}" for key, _ in COLUMNS))
    return "\n".join(lines)


def qualitative_facts(reports: dict[str, ProbeReport]) -> dict[str, float | bool]:
    """The paper's three statements, as ratios against peers measured in this run."""
    others = [m for m in METHODS if m != "prp"]
    max_other_var = max(reports[m].grad_variance for m in others)
    sgt_gain = reports["sgt"].support_gain
    return {
        "prp_variance_over_max_other": reports["prp"].grad_variance / max_other_var,
        "prp_highest_variance": reports["prp"].grad_variance > max_other_var,
        "xgrpo_gain_never": reports["xgrpo"].support_gain_never,
        "xgrpo_gain_rare_over_sgt": reports["xgrpo"].support_gain / sgt_gain if sgt_gain else math.nan,
        "xgrpo_no_gain_on_unsampled_arms": reports["xgrpo"].support_gain_never == 0.0,
        "sgt_gain_rare": sgt_gain,
        "sgt_positive_gain_toward_peer_success": sgt_gain > 0.0,
        "prp_c2_variance_over_grpo": reports["prp_c2"].grad_variance / reports["grpo"].grad_variance,
    }


def plot(reports: dict[str, ProbeReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rep in reports.items():
        style = "--" if name.startswith("prp_c") else "-"
        curves.plot(rep.curve, style, label=name)
    curves.set(xlabel="update", ylabel="mean success over prompts", title="learning curves (sampled groups)")
    curves.legend(fontsize=8)
    names = list(reports)
    x = torch.arange(len(names)).tolist()
    bars.bar([i - 0.2 for i in x], [reports[n].grad_variance for n in names], width=0.4, label="Var u")
    bars.bar([i + 0.2 for i in x], [reports[n].support_gain for n in names], width=0.4, label="gain on rare success arms")
    bars.set_xticks(x, names, rotation=30, fontsize=8)
    bars.set_yscale("symlog", linthresh=1e-3)
    bars.set(title="exact gradient statistics at the start")
    bars.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: extra threads only contend on a shared box
    start = time.perf_counter()
    bandit = paper_bandit(residual_scale=args.residual, seed=args.seed)
    reports = analyse(bandit, steps=args.steps, lr=args.lr, replicas=args.replicas, seed=args.seed)
    facts = qualitative_facts(reports)
    try:
        plot(reports, args.out)
    except OSError as err:
        print(f"cannot write the plot to {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(format_table(reports))
    print(f"\nplot: {args.out}   ({seconds:.2f} s, G = {bandit.group_size}, Gp = {bandit.peer_group_size})")
    keys = [key for key, _ in COLUMNS]
    summary = {
        "bench": "bandit",
        "methods": {name: {key: getattr(rep, key) for key in keys} for name, rep in reports.items()},
        "facts": facts,
        "plot": str(args.out),
        "seconds": round(seconds, 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
