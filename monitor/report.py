"""The run report: ``report.md`` and its PNG plots, for one run or several overlaid.

``python launch.py report RUN_DIR [RUN_DIR ...] [--out DIR]``; ``launch.py run`` and
``resume`` write one into the run directory when the run ends. With several runs (solo
against mutual, say) every plot overlays them, a line per run, and the table has a row
per run and model.
"""

from __future__ import annotations

import sys
from pathlib import Path

from monitor.rundata import ReportError, RunData, read_run

TRAIN_WINDOW_STEPS = 10  # the training cut spans the last steps, as the launcher's table (engine.record.truncation)

EXPLAIN = {
    "accuracy.png": "Held-out accuracy: the share of problems never trained on that the model solves, "
                    "before RL (the warm start), during it (a smaller live set, so noisier) and after it.",
    "reward.png": "Reward of the samples each learner step trained on, against samples trained and against "
                  "wall-clock time: the model's success rate on its own training prompts.",
    "throughput.png": "Own samples trained per second, per model: how fast each model learns in wall time.",
    "staleness.png": "How many weight versions behind the learner a sample's generator was: asynchrony's "
                     "price (0 means generated with the newest weights).",
    "thl_residual.png": "The tokenizer bridge (THL) turns a peer's tokens into this model's tokens. The "
                        "residual is the share of characters whose tokens do not map one-to-one; such samples "
                        "still train, their token-level figures spread over the group. Digits alone can make "
                        "it 1.0: GPT-2 writes ' 42' as one token, Mistral as three.",
    "rescue.png": "SGT's rescue set: prompts on which this model failed every sample while a peer succeeded; "
                  "the peer's success is what it learns from there.",
    "allocation.png": "Which worker did what over time (MWRA moves workers between generating and learning).",
}

TITLES = {"thl_residual.png": "THL residual", "rescue.png": "Rescue set (SGT)", "allocation.png": "Allocation (MWRA)"}


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the report; returns the path of ``report.md``. Raises ReportError on bad input."""
    if not run_dirs:
        raise ReportError("name at least one run directory")
    runs = [read_run(p) for p in run_dirs]
    if out is None and len(runs) > 1:
        raise ReportError("several runs: say where the report goes with --out DIR")
    out = Path(out) if out is not None else runs[0].path
    out.mkdir(parents=True, exist_ok=True)
    from monitor import plots  # matplotlib: a third of a second, paid by the report only, not by every launch.py command

    figures = [name for fig in plots.FIGURES if (name := fig(runs, out))]
    path = out / "report.md"
    path.write_text(_markdown(runs, figures))
    return path


def _markdown(runs: list[RunData], figures: list[str]) -> str:
    names = ", ".join(f"`{r.name}` ({r.objective})" for r in runs)
    lines = [f"# Run report: {names}", "",
             "Each model was trained with reinforcement learning while it shared experience with its peers "
             "(objective in brackets: `grpo` trains alone, `prp`/`xgrpo`/`sgt` use the peers' samples). "
             "Accuracies are on held-out problems, with one standard error (SE). *Cut*: the share of completions "
             "that hit `max_new_tokens` without EOS, in the held-out evaluations before → after RL and among the "
             f"model's own training samples of its last {TRAIN_WINDOW_STEPS} steps; past a fifth, the length cap "
             "rather than the model decides the accuracy (raise `train.max_new_tokens`).", "",
             "| run | model | before RL | after RL | gain | cut (eval) | cut (train) | steps | own samples "
             "| peer samples used | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for model in run.models:
            lines.append(_row(run, model))
    for run in runs:
        lines += _run_notes(run)
    for name in figures:
        title = TITLES.get(name) or name.removesuffix(".png").replace("_", " ").capitalize()
        lines += ["", f"## {title}", "", EXPLAIN.get(name, ""),
                  "", f"![{name}]({name})"]
    return "\n".join(lines) + "\n"


def _row(run: RunData, model: str) -> str:
    start, final = run.starts.get(model, {}), run.finals.get(model)
    steps = run.steps.get(model, [])
    before = _pct(start.get("warm_accuracy"), start.get("warm_accuracy_stderr"))
    last = final or (steps[-1] if steps else {})
    if final is not None:
        after = _pct(final.get("accuracy"), final.get("accuracy_stderr"))
        w, a = start.get("warm_accuracy"), final.get("accuracy")
        gain = f"{100 * (a - w):+.1f} pts" if w is not None and a is not None else "-"
    else:
        after, gain = "- (no final evaluation)", "-"
    wall = last.get("wall_s") or (round(steps[-1]["time"] - run.t0, 1) if steps else "-")
    cut = f"{_share(run.warm_starts.get(model, {}).get('truncated'))} → {_share((final or {}).get('truncated'))}"
    return (f"| {run.name} | {model} | {before} | {after} | {gain} | {cut} | {_share(_train_cut(steps))} | "
            f"{last.get('step', '-')} | {last.get('own_experiences', '-')} | {last.get('peer_used', '-')} | {wall} |")


def _pct(value, stderr) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}% ± {100 * (stderr or 0):.1f}"


def _share(frac) -> str:
    return "-" if frac is None else "<1%" if 0 < frac < 0.005 else f"{100 * frac:.0f}%"


def _train_cut(steps: list[dict]) -> float | None:
    """Mean truncated_frac of the last steps (as the launcher's table; None for a run from before it was kept)."""
    fracs = [r["truncated_frac"] for r in steps[-TRAIN_WINDOW_STEPS:] if r.get("truncated_frac") is not None]
    return sum(fracs) / len(fracs) if fracs else None


def _run_notes(run: RunData) -> list[str]:
    notes = []
    audit = (run.result or {}).get("audit")
    if audit:
        notes.append(f"experience log audit: {audit['logged']} logged, {audit['lost']} lost, "
                     f"{audit['duplicates']} duplicated")
    if run.result is None:
        notes.append("no run_result.json: the run is still going, or it did not finish")
    for name in ("FAILED", "INTERRUPTED"):
        if (run.path / name).is_file():
            notes.append(f"{name}: {(run.path / name).read_text().strip().splitlines()[0]}")
    for ev in run.events:
        what = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("time", "event", "model", "checkpoint"))
        notes.append(f"{ev['event']} ({ev.get('model')}): {what}")
    if run.skipped_lines:
        notes.append(f"{run.skipped_lines} unreadable lines of metrics.jsonl skipped (a torn write)")
    return ["", f"**{run.name}**: " + "; ".join(notes)] if notes else []


def report_command(args) -> int:
    try:
        path = write_report(args.run_dirs, args.out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("report", help="write report.md with plots for one run, or several overlaid")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: overlaid)")
    p.add_argument("--out", default=None, help="where report.md and its PNGs go (default: the run directory; "
                                               "required for several runs)")
    p.set_defaults(handler=report_command)
