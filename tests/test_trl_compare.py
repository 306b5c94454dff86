"""benchmarks.trl_compare's setup: what each side trains is the config's first model alone under solo GRPO, with
the budget asked for (the runs themselves take half an hour: docs/benchmarks.md has their figures)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from benchmarks.trl_compare import solo_tree

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "configs" / "smollm2.toml"


def test_both_sides_train_the_configs_first_model_alone_with_one_budget():
    base = tomllib.loads(SMOLLM2.read_text())
    timed = solo_tree(SMOLLM2, seed=2, minutes=None, steps=None)
    assert [m["name"] for m in timed["models"]] == [base["models"][0]["name"]]
    assert timed["objective"] == {"kind": "grpo"} and timed["run"]["seed"] == 2
    assert timed["run"]["max_minutes"] == base["run"]["max_minutes"] and timed["eval"]["every_steps"] == 0
    assert timed["train"] == base["train"] and timed["task"] == base["task"]  # the setup itself is untouched
    assert timed["timeouts"] == base["timeouts"]  # a solo SmolLM2's first step outlasts the default peer_silent_s
    stepped = solo_tree(SMOLLM2, seed=0, minutes=None, steps=27, overrides=["models.0.lr=2e-5", "eval.num_problems=50"])
    assert stepped["train"]["steps"] == 27 and stepped["run"]["max_minutes"] >= 24 * 60  # steps, not the clock
    assert stepped["models"][0]["lr"] == 2e-5 and stepped["eval"]["num_problems"] == 50
    peer = solo_tree(SMOLLM2, seed=0, minutes=None, steps=400, overrides=["train.lr=3e-4"], model="llama")
    assert [m["name"] for m in peer["models"]] == ["llama"] and peer["train"]["lr"] == 3e-4  # the small peer alone


def test_a_bad_override_is_one_line():
    done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--only", "project", "--set", "train"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "expected KEY=VALUE" in done.stderr
