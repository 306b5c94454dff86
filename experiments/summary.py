"""results.md from results.csv: gains per arm with 95% intervals over seeds, each arm against solo
GRPO and against solo plus the answer key (paired by seed: the arms of a seed share the warm
start), the objectives' own costs, and plain answers that say only what the intervals support."""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import fmean

from experiments.stats import Estimate, estimate, verdict

COSTS = [("thl_residual", "THL residual"), ("prp_w_var", "PRP w variance"), ("prp_truncated_frac", "PRP truncated"),
         ("sgt_rescue_set", "rescue set / step"), ("xgrpo_baseline_shift", "XGRPO baseline shift"),
         ("xgrpo_fallback_frac", "XGRPO fallback"), ("cut_train", "cut (train)"), ("cut_eval_after", "cut (final eval)")]


def pts(e: Estimate, signed: bool = True) -> str:
    mean = f"{100 * e.mean:+.1f}" if signed else f"{100 * e.mean:.1f}"
    if math.isnan(e.low):
        return mean
    return f"{mean} [{100 * e.low:+.1f}, {100 * e.high:+.1f}]"


def _p(p: float) -> str:
    return "p<0.01" if p < 0.005 else f"p={p:.2f}"


def _by(rows: list[dict], *keys: str) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def paired(rows: list[dict], arm: str, base: str) -> Estimate | None:
    """Gain of ``arm`` minus gain of ``base``, seed by seed (the seeds both have)."""
    gains = {(r["arm"], r["seed"]): r["gain"] for r in rows}
    seeds = sorted({s for a, s in gains if a == arm} & {s for a, s in gains if a == base})
    return estimate([gains[(arm, s)] - gains[(base, s)] for s in seeds]) if seeds else None


def cell_section(task: str, model_set: str, rows: list[dict], arms: list[str], baseline: str, control: str) -> list[str]:
    models = list(dict.fromkeys(r["model"] for r in rows))
    present = [a for a in arms if any(r["arm"] == a for r in rows)]
    seeds = sorted({int(r["seed"]) for r in rows})
    out = [f"## {task}, {model_set} ({', '.join(models)})", "",
           f"Seeds {', '.join(map(str, seeds))}; {int(rows[0]['samples']):,} own samples per model per run; "
           f"held-out accuracy on {int(rows[0]['eval_n'])} problems.", "",
           "Accuracy gain from RL, points (mean over seeds [95% interval]):", "",
           "| model | before | " + " | ".join(present) + " |", "|---|---|" + "---|" * len(present)]
    by_model = _by(rows, "model")
    for m in models:
        mr = by_model[(m,)]
        before = fmean(r["acc_before"] for r in mr)
        cells = [pts(estimate([r["gain"] for r in mr if r["arm"] == a])) for a in present]
        out.append(f"| {m} | {100 * before:.1f}% | " + " | ".join(cells) + " |")
    for ref, label in ((baseline, "solo GRPO"), (control, "solo GRPO + reference guidance")):
        if ref not in present:
            continue
        others = [a for a in present if a != ref]
        out += ["", f"Against {label} (`{ref}`), gain difference in points, paired by seed [95% interval] (p):", "",
                "| model | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
        for m in models:
            cells = []
            for a in others:
                e = paired(by_model[(m,)], a, ref)
                cells.append("-" if e is None else f"{pts(e)} ({_p(e.p)})" if not math.isnan(e.p) else pts(e))
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "Objectives' own figures (mean over steps and seeds). THL residual: the share of a peer's completion "
            "that does not map one-to-one onto the receiver's tokens (GPT-2 writes \" 42\" as one token, Mistral as "
            "three: that group is not one-to-one), measured for every peer sample received, whether the arm reads it "
            "or not. Cut: the share of completions that hit max_new_tokens without EOS, the model's own training samples "
            "and its final evaluation's (a cap that cuts what RL learned turns learning into measured loss):", "",
            "| model | arm | " + " | ".join(label for _, label in COSTS) + " |", "|---|---|" + "---|" * len(COSTS)]
    for m in models:
        for a in present:
            vals = []
            for col, _ in COSTS:
                xs = [r[col] for r in by_model[(m,)] if r["arm"] == a and r.get(col) is not None]  # old csv: none
                vals.append(f"{fmean(xs):.3g}" if xs else "-")
            out.append(f"| {m} | {a} | " + " | ".join(vals) + " |")
    return out + [""] + answers(rows, models, present, baseline, control) + [""]


def answers(rows: list[dict], models: list[str], arms: list[str], baseline: str, control: str) -> list[str]:
    """Plain sentences, each backed by an interval of the tables above."""
    out = ["Answers:", ""]
    by_model = _by(rows, "model")
    sharing = [a for a in arms if a not in (baseline, control)]
    for m in models:
        mr = by_model[(m,)]
        for ref in (baseline, control):
            if ref not in arms:
                continue
            said = []
            for a in sharing:
                e = paired(mr, a, ref)
                if e is not None:
                    said.append(f"{a}: {verdict(e)} ({pts(e)})")
            if said:
                out.append(f"- {m}, against `{ref}`: " + "; ".join(said) + ".")
        best = max(arms, key=lambda a: fmean(r["gain"] for r in mr if r["arm"] == a))
        runner_up = [a for a in arms if a != best]
        e = paired(mr, best, max(runner_up, key=lambda a: fmean(r["gain"] for r in mr if r["arm"] == a))) if runner_up else None
        sure = "" if e is None else (" and its lead over the next is clear" if verdict(e) == "better"
                                     else " but its lead over the next arm is within the noise")
        out.append(f"- {m}: the largest mean gain is {best}'s{sure}.")
    if len(models) >= 2 and sharing:
        before = {m: fmean(r["acc_before"] for r in by_model[(m,)]) for m in models}
        weak, strong = min(models, key=before.get), max(models, key=before.get)
        lift = {m: [paired(by_model[(m,)], a, baseline) for a in sharing] for m in (weak, strong)}
        mean_lift = {m: fmean(e.mean for e in lift[m] if e is not None) for m in lift if any(lift[m])}
        if len(mean_lift) == 2:
            out.append(f"- Weaker model ({weak}, {100 * before[weak]:.1f}% before) vs stronger ({strong}, "
                       f"{100 * before[strong]:.1f}%): mean gain over solo across the sharing arms "
                       f"{100 * mean_lift[weak]:+.1f} vs {100 * mean_lift[strong]:+.1f} points"
                       " (compare the intervals above before reading this as a difference).")
    return out


def write_markdown(rows: list[dict], arms: list[str], baseline: str, control: str, header: list[str]) -> str:
    lines = list(header)
    for (task, model_set), cell in _by(rows, "task", "model_set").items():
        lines += cell_section(task, model_set, cell, arms, baseline, control)
    return "\n".join(lines) + "\n"
