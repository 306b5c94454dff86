"""The report's figures: one PNG each, a panel per model, a line per run (several runs overlay)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from monitor.rundata import RunData, series  # noqa: E402


def _models(runs: list[RunData]) -> list[str]:
    return list(dict.fromkeys(m for r in runs for m in r.models if r.steps.get(m)))


def _label(run: RunData, runs: list[RunData], extra: str = "") -> str:
    base = run.objective if len({r.objective for r in runs}) == len(runs) else run.name
    return f"{base}{extra}" if len(runs) > 1 else (extra.lstrip(": ") or run.name)


def _panels(runs: list[RunData], title: str, xlabel: str, ylabel: str, draw, rows: int = 1):
    models = _models(runs)
    fig, axes = plt.subplots(rows, len(models), figsize=(4.6 * len(models), 3.4 * rows), squeeze=False)
    drew = False
    for j, model in enumerate(models):
        for i in range(rows):
            ax = axes[i][j]
            for k, run in enumerate(runs):
                drew |= bool(draw(ax, run, model, f"C{k}", i))
            ax.set_title(f"{model}" if rows == 1 else f"{model} ({'samples' if i == 0 else 'wall time'})")
            ax.set_xlabel(xlabel if rows == 1 else ("own samples trained" if i == 0 else "seconds since the first step"))
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig if drew else None


def _save(fig, out: Path, name: str) -> str | None:
    if fig is None:
        return None
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _rolling(ys: list[float], n: int = 5) -> list[float]:
    return [sum(ys[max(0, i - n + 1):i + 1]) / len(ys[max(0, i - n + 1):i + 1]) for i in range(len(ys))]


def reward(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, row):
        recs = run.steps.get(model, [])
        xs = [r.get("own_experiences", 0) for r in recs] if row == 0 else [r["time"] - run.t0 for r in recs]
        ys = [r.get("reward_mean", 0.0) for r in recs]
        ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
        ax.plot(xs, _rolling(ys), color=color, lw=1.6, label=_label(run, runs))
        return recs
    return _save(_panels(runs, "Reward of each step's own samples (faint: per step; bold: mean of 5 steps)",
                         "", "mean reward", draw, rows=2), out, "reward.png")


def accuracy(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, _):
        recs = run.steps.get(model, [])
        xs, ys = series(recs, "accuracy")
        start, final = run.starts.get(model, {}), run.finals.get(model)
        if start.get("warm_accuracy") is not None:
            xs, ys = [0, *xs], [start["warm_accuracy"], *ys]
            ax.errorbar([0], [100 * start["warm_accuracy"]], yerr=[100 * (start.get("warm_accuracy_stderr") or 0)],
                        color=color, fmt="o", ms=4, capsize=3)
        if final is not None:
            xs, ys = [*xs, final.get("own_experiences", xs[-1] if xs else 0)], [*ys, final["accuracy"]]
            ax.errorbar([xs[-1]], [100 * final["accuracy"]], yerr=[100 * (final.get("accuracy_stderr") or 0)],
                        color=color, fmt="s", ms=4, capsize=3)
        ax.plot(xs, [100 * y for y in ys], color=color, lw=1.6, label=_label(run, runs))
        return xs
    return _save(_panels(runs, "Held-out accuracy (o: warm start, s: final, both with ±1 SE; between: live evals "
                         "on fewer problems)", "own samples trained", "accuracy (%)", draw), out, "accuracy.png")


def staleness(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, _):
        recs = run.steps.get(model, [])
        ax.plot([r["step"] for r in recs], [r.get("staleness_mean", 0) for r in recs], color=color, lw=1.4,
                label=_label(run, runs))
        return recs
    return _save(_panels(runs, "Staleness: learner version minus the version that generated a sample, minus 1",
                         "learner step", "mean staleness (versions)", draw), out, "staleness.png")


def thl_residual(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, _):
        recs, drew = run.steps.get(model, []), False
        peers = sorted({p for r in recs for p in (r.get("thl_residual_by_peer") or {})})
        styles = ["-", "--", ":", "-."]
        for i, peer in enumerate(peers):
            pts = [(r["step"], r["thl_residual_by_peer"][peer]) for r in recs
                   if peer in (r.get("thl_residual_by_peer") or {})]
            ax.plot(*zip(*pts), color=color, ls=styles[i % 4], lw=1.4, label=_label(run, runs, f": {peer} -> {model}"))
            drew = True
        if not peers:  # runs from before the per-peer figure: the mean over all peers
            pts = [(r["step"], r["thl_residual_mean"]) for r in recs if r.get("thl_residual_mean") is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, lw=1.4, label=_label(run, runs, f": peers -> {model}"))
                drew = True
        return drew
    return _save(_panels(runs, "THL residual per pair: share of a peer sample's characters in token groups "
                         "that are not 1:1 across the vocabularies", "learner step", "mean residual", draw), out, "thl_residual.png")


def rescue(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, _):
        pts = [(r["step"], r["obj/rescue_set_size"]) for r in run.steps.get(model, []) if "obj/rescue_set_size" in r]
        if pts:
            ax.plot(*zip(*pts), color=color, lw=1.4, label=_label(run, runs))
        return pts
    return _save(_panels(runs, "SGT rescue set: prompts where this model failed every sample and a peer succeeded",
                         "learner step", "prompts rescued", draw), out, "rescue.png")


def throughput(runs: list[RunData], out: Path) -> str | None:
    def draw(ax, run, model, color, _):
        recs = run.steps.get(model, [])
        pts = []
        for a, b in zip(recs, recs[1:]):
            dt = b["time"] - a["time"]
            if dt > 0:
                pts.append((b["time"] - run.t0, (b.get("own_experiences", 0) - a.get("own_experiences", 0)) / dt))
        if pts:
            ax.plot([x for x, _ in pts], _rolling([y for _, y in pts]), color=color, lw=1.4, label=_label(run, runs))
        return pts
    return _save(_panels(runs, "Samples trained per second (mean of 5 steps)", "seconds since the first step",
                         "own samples / s", draw), out, "throughput.png")


def allocation(runs: list[RunData], out: Path) -> str | None:
    shown = [r for r in runs if len(r.allocations) > 1 or (r.allocations and len(runs) == 1)]
    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(7.5, 2.6 * len(shown)), squeeze=False)
    for ax, run in zip(axes[:, 0], shown):
        keys = sorted({k for a in run.allocations for k in a["counts"]})
        ts = [a.get("t", 0.0) for a in run.allocations]
        ax.stackplot(ts, [[a["counts"].get(k, 0) for a in run.allocations] for k in keys], labels=keys, step="post")
        ax.set_title(f"{run.name}: workers per role", fontsize=9)
        ax.set_xlabel("seconds since the RL phase began")
        ax.set_ylabel("workers")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _save(fig, out, "allocation.png")


FIGURES = (accuracy, reward, throughput, staleness, thl_residual, rescue, allocation)
