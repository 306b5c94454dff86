"""What a finished run says, as rows: one per (run, model), from its records (``exchange.records``) and run_result.json.

Every figure of results.md is computed from these rows (results.csv), never from the runs.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from statistics import fmean

from exchange.records import read_records
from exchange.records import steps as step_records

# Per-step objective figures averaged over a run's steps: (column, metrics key).
STEP_MEANS = [
    ("thl_residual", "thl_residual_mean"),
    ("prp_w_var", "obj/w_var"),
    ("prp_truncated_frac", "obj/w_truncated_frac"),
    ("sgt_rescue_set", "obj/rescue_set_size"),
    ("xgrpo_baseline_shift", "obj/baseline_shift_mean"),
    ("xgrpo_fallback_frac", "obj/baseline_fallback_frac"),
    ("cut_train", "truncated_frac"),  # own samples cut at train.max_new_tokens
]
COLUMNS = ["task", "model_set", "arm", "seed", "model", "acc_before", "se_before", "acc_after", "se_after", "gain",
           "eval_n", "steps", "samples", "rl_s", "peer_used", "sgt_rescued_total", "cut_eval_after",
           *[c for c, _ in STEP_MEANS]]


def records(run_dir: Path) -> list[dict]:
    return read_records(run_dir).records


def read_run(run_dir: Path, run) -> list[dict]:
    """The rows of one finished run (``run``: its PlannedRun)."""
    recs = records(run_dir)
    rl_s = json.loads((run_dir / "run_result.json").read_text())["duration_s"]
    rows = []
    for model in run.config.names:
        final = next(r for r in recs if r.get("model") == model and r.get("event") == "final")
        steps = step_records(recs, model)
        row = dict(task=run.task, model_set=run.model_set, arm=run.arm, seed=run.seed, model=model,
                   acc_before=final["warm_accuracy"], se_before=final["warm_accuracy_stderr"],
                   acc_after=final["accuracy"], se_after=final["accuracy_stderr"],
                   gain=final["accuracy"] - final["warm_accuracy"], eval_n=final["eval_n"], steps=final["step"],
                   samples=final["own_experiences"], rl_s=rl_s, peer_used=final["peer_used"],
                   sgt_rescued_total=sum(r.get("obj/rescue_set_size") or 0 for r in steps),
                   cut_eval_after=final.get("truncated"))  # the final evaluation's completions cut
        for column, key in STEP_MEANS:
            values = [r[key] for r in steps if r.get(key) is not None]
            row[column] = fmean(values) if values else None
        rows.append(row)
    return rows


def curves(run_dir: Path, run) -> list[dict]:
    """Live held-out accuracy during RL: (model, samples trained, accuracy) points, the warm start first."""
    points = []
    per_step = run.config.train.prompts_per_step * run.config.train.group_size
    for r in records(run_dir):
        model = r.get("model")
        if r.get("event") == "start" and r.get("warm_accuracy") is not None:
            points.append(dict(model=model, samples=0, accuracy=r["warm_accuracy"]))
        elif r.get("event") in ("step", "final") and r.get("accuracy") is not None:
            points.append(dict(model=model, samples=r["step"] * per_step, accuracy=r["accuracy"]))
    return points


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})


def read_csv(path: Path) -> list[dict]:
    numeric = set(COLUMNS) - {"task", "model_set", "arm", "model"}
    with open(path, newline="") as f:
        return [{k: (None if v == "" else float(v)) if k in numeric else v for k, v in row.items()}
                for row in csv.DictReader(f)]
