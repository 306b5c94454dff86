"""PNG plots of an experiment, from its CSV files: learning curves with seed bands, gains with intervals."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from statistics import fmean

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from experiments.stats import estimate  # noqa: E402


def learning_curves(points: list[dict], arms: list[str], out: Path) -> list[Path]:
    """One figure per (task, model set): a panel per model, a line per arm (mean over seeds, min-max band)."""
    written = []
    cells = sorted({(p["task"], p["model_set"]) for p in points})
    for task, model_set in cells:
        cell = [p for p in points if p["task"] == task and p["model_set"] == model_set]
        models = list(dict.fromkeys(p["model"] for p in cell))
        fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models):
            for arm in [a for a in arms if any(p["arm"] == a for p in cell)]:
                by_x: dict[float, list[float]] = defaultdict(list)
                for p in cell:
                    if p["model"] == model and p["arm"] == arm:
                        by_x[p["samples"]].append(100 * p["accuracy"])
                xs = sorted(by_x)
                line, = ax.plot(xs, [fmean(by_x[x]) for x in xs], label=arm, lw=1.6)
                ax.fill_between(xs, [min(by_x[x]) for x in xs], [max(by_x[x]) for x in xs], color=line.get_color(),
                                alpha=0.15, lw=0)
            ax.set_title(model)
            ax.set_xlabel("own samples trained")
            ax.set_ylabel("held-out accuracy (%)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{task}, {model_set}: mean over seeds, band = min..max (live eval on fewer problems)", fontsize=9)
        written.append(_save(fig, out / f"curves-{task}-{model_set}.png"))
    return written


def gains(rows: list[dict], arms: list[str], out: Path) -> list[Path]:
    """One bar chart per (task, model set): gain per model and arm, with its 95% interval over seeds."""
    written = []
    for task, model_set in sorted({(r["task"], r["model_set"]) for r in rows}):
        cell = [r for r in rows if r["task"] == task and r["model_set"] == model_set]
        models = list(dict.fromkeys(r["model"] for r in cell))
        present = [a for a in arms if any(r["arm"] == a for r in cell)]
        width = 0.8 / len(present)
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(models) * len(present) / 3, 3.4))
        for i, arm in enumerate(present):
            ests = [estimate([r["gain"] for r in cell if r["model"] == m and r["arm"] == arm]) for m in models]
            means = [100 * e.mean for e in ests]
            errs = [0 if math.isnan(e.low) else 100 * (e.high - e.mean) for e in ests]
            ax.bar([j + (i - (len(present) - 1) / 2) * width for j in range(len(models))], means, width, yerr=errs,
                   capsize=3, label=arm)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel("accuracy gain from RL (points)")
        ax.set_title(f"{task}, {model_set}: mean over seeds, 95% interval", fontsize=9)
        ax.legend(fontsize=8, ncol=len(present))
        ax.grid(axis="y", alpha=0.3)
        written.append(_save(fig, out / f"gains-{task}-{model_set}.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
