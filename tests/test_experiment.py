"""The experiment runner: a tiny grid end to end (real runs), resuming, the results files; the plan of the
GPU grid here; grid errors; the t statistics against known values."""

from __future__ import annotations

import csv
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from enginerun import Run

from engine.config import ConfigError
from experiments.grid import load_grid, plan
from experiments.runner import code_version, commit_problem
from experiments.stats import estimate, t_quantile

ROOT = Path(__file__).resolve().parents[1]


def _grid(tmp_path: Path, cache: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(f"""
base = "{ROOT / 'configs/smoke.toml'}"
out = "{tmp_path / 'results'}"
arms = ["grpo", "sgt_ref"]
seeds = [0]
set = ["train.steps=4", "eval.num_problems=18", "eval.every_steps=2", "eval.live_problems=10",
       "run.cache_dir='{cache}'"]

[[model_sets]]
name = "pair"
models = [{{name = "gpt2", arch = "gpt2", tokenizer = "gpt2"}}, {{name = "llama", arch = "llama", tokenizer = "mistral"}}]

[[tasks]]
name = "arith"
task = {{kind = "arithmetic", min_digits = 1, max_digits = 1, ops = ["+"], eval_fraction = 0.2}}  # smoke.toml's
""")
    return path


def _experiment(*args: str) -> subprocess.CompletedProcess:
    # --allow-dirty: the suite runs in work trees with uncommitted changes too (the refusal: tested below)
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "experiment", *args, "--allow-dirty"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_a_tiny_grid_runs_end_to_end_and_resumes(tmp_path, engine_cache):
    """A Ctrl-C once the second run has started stops the grid (its first run kept); the same command goes on
    with the second run only, then writes the results; run again, it has nothing to do."""
    grid = _grid(tmp_path, engine_cache)
    out = tmp_path / "results"
    first = Run.command(out, "experiment", str(grid), "--allow-dirty")
    first.wait_for(lambda: "arith-pair-sgt_ref-s0: running" in first.out, "the second run's start", timeout=600)
    first.signal(signal.SIGINT)  # a terminal's Ctrl-C: the runner and the run it started
    assert first.finish() == 130, first.out
    assert "arith-pair-grpo-s0: done" in first.out and "run the same command again to go on" in first.out
    assert not (out / "results.csv").exists()

    done = _experiment(str(grid))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sgt_ref-s0: running" in done.stdout and "grpo-s0: running" not in done.stdout  # where it stopped
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert sorted((r["arm"], r["model"]) for r in rows) == [("grpo", "gpt2"), ("grpo", "llama"),
                                                            ("sgt_ref", "gpt2"), ("sgt_ref", "llama")]
    for r in rows:
        assert int(r["samples"]) == 4 * 8 * 8 and int(r["steps"]) == 4  # the same budget for every arm
        assert 0 <= float(r["acc_after"]) <= 1 and math.isclose(float(r["gain"]),
                                                                 float(r["acc_after"]) - float(r["acc_before"]))
    ref = [r for r in rows if r["arm"] == "sgt_ref"]
    assert all(r["sgt_rescue_set"] != "" for r in ref)  # the control ran SGT's term (on reference solutions)
    assert all(r["sgt_rescue_set"] == "" for r in rows if r["arm"] == "grpo")
    assert all(0 <= float(r["cut_train"]) <= 1 and 0 <= float(r["cut_eval_after"]) <= 1 for r in rows)  # the cap's share
    md = (out / "results.md").read_text()
    assert "## arith, pair (gpt2, llama)" in md and "Against solo GRPO (`grpo`)" in md and "sgt_ref" in md
    assert (out / "curves-arith-pair.png").stat().st_size > 0 and (out / "gains-arith-pair.png").stat().st_size > 0
    curves = list(csv.DictReader(open(out / "curves.csv")))
    assert {c["samples"] for c in curves} >= {"0", str(2 * 64), str(4 * 64)}

    again = _experiment(str(grid))  # nothing finished is run again
    assert again.returncode == 0 and "0 of 2 runs to go" in again.stdout and "running" not in again.stdout

    grid.write_text(grid.read_text().replace('"eval.every_steps=2"', '"eval.every_steps=4"'))  # the grid edited
    edited = _experiment(str(grid), "--dry-run")  # its finished runs ran another config: neither counts now
    assert edited.returncode == 0 and "2 of 2 runs to go" in edited.stdout, edited.stdout + edited.stderr
    assert edited.stdout.count("to run again: its config changed since it ran") == 2
    assert edited.stdout.count("min of RL, whichever is first") == 2  # run.max_minutes may end a run first


def test_a_grid_names_one_commit_and_refuses_to_run_on_uncommitted_or_other_code(tmp_path):
    """results/smollm2's twelve runs came from ten commits, four with uncommitted changes: never again unless told."""
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    for name in ("code.py", "results/results.md"):
        (repo / name).write_text("v1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "v1")
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    (repo / "results" / "results.md").write_text("the grid's own results, written as it goes\n")
    assert code_version(repo / "results", root=repo) == head  # the results folder is the runner's to write
    assert code_version(root=repo) == head + "+local-changes"
    assert code_version(tmp_path / "elsewhere", root=repo) == head + "+local-changes"  # a results folder outside
    (repo / "code.py").write_text("v2\n")
    dirty = code_version(repo / "results", root=repo)
    assert dirty == head + "+local-changes"
    assert "uncommitted changes" in commit_problem(dirty, set(), allow_dirty=False, allow_mixed=False)
    assert commit_problem(dirty, set(), allow_dirty=True, allow_mixed=False) is None
    other = commit_problem("abc1234", {head}, allow_dirty=False, allow_mixed=False)
    assert f"ran on {head}" in other and f"git worktree add ../grid {head}" in other
    assert commit_problem("abc1234", {head}, allow_dirty=False, allow_mixed=True) is None
    assert commit_problem(head, {head}, allow_dirty=False, allow_mixed=False) is None


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_the_gpu_grid_plans_here_and_reads_its_checkpoints_configs(tmp_path):
    """Where the checkpoints are in place (here their config.json only, as transformers writes them), --dry-run
    reads each with transformers and checks it is the arch the grid says; a wrong one is one line and exit 2."""
    from transformers import LlamaConfig, Qwen2Config

    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # the grid's paths are the working directory's
    grid = tmp_path / "configs/experiments/math.toml"
    runs = lambda: subprocess.run([sys.executable, str(ROOT / "launch.py"), "experiment", str(grid), "--dry-run",  # noqa: E731
                                   "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=600)
    qwen, llama = (tmp_path / "checkpoints" / n for n in ("Qwen2.5-1.5B-Instruct", "Llama-3.2-1B-Instruct"))
    Qwen2Config().save_pretrained(qwen)
    LlamaConfig().save_pretrained(llama)
    done = runs()
    assert done.returncode == 0, done.stderr
    assert "15 runs" in done.stdout and "math-qwen-llama-sgt_ref-s2" in done.stdout
    assert "absent here" in done.stdout and "data/math/train.jsonl" in done.stdout
    assert "Qwen2.5" not in done.stdout.split("absent here")[1]  # its config is here now
    LlamaConfig().save_pretrained(qwen)  # a grid that names the wrong arch for what is on disk
    done = runs()
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "model 'qwen'" in done.stderr and "is a 'llama' model but its arch is 'qwen2'" in done.stderr


def test_the_cpu_grid_plans_every_arm_with_one_budget():
    runs = plan(load_grid(ROOT / "configs/experiments/cpu.toml"))
    assert {r.arm for r in runs} == {"grpo", "sgt_ref", "prp", "xgrpo", "sgt"} and len({r.seed for r in runs}) >= 3
    assert {(r.task, r.model_set) for r in runs} == {("countdown", "pair"), ("countdown", "trio"),
                                                     ("arithmetic", "pair")}
    assert len({(r.config.train, r.config.warmstart, r.config.eval) for r in runs}) == 2  # per task only
    tokenizers = {m.tokenizer for r in runs for m in r.config.models}
    assert tokenizers == {"gpt2", "mistral", "qwen2"}


def test_a_finished_run_counts_while_its_config_is_the_one_planned(tmp_path):
    """Compared as configs: a key the schema gained since (at its default) changes nothing; a value does."""
    import tomllib

    import msgspec

    from engine.record.rundir import config_toml
    from experiments.runner import changed

    run = plan(load_grid(ROOT / "configs/experiments/cpu.toml"))[0]
    saved = tomllib.loads(config_toml(run.config).decode())
    write = lambda tree: (tmp_path / "config.toml").write_bytes(msgspec.toml.encode(tree))  # noqa: E731
    write(saved)
    assert not changed(tmp_path, run)
    del saved["pool"]["threads_per_worker"]  # as if written before the key existed: its default is what ran
    write(saved)
    assert not changed(tmp_path, run)
    saved["train"]["lr"] = run.config.train.lr * 2
    write(saved)
    assert changed(tmp_path, run)
    saved["train"]["lr"] = run.config.train.lr
    saved["pool"]["gone_key"] = 1  # a key the schema no longer has
    write(saved)
    assert changed(tmp_path, run)


def test_a_finished_run_from_a_gguf_file_counts_as_the_file_it_was_converted_from(tmp_path, monkeypatch):
    """A run saves its checkpoint resolved (the GGUF file's converted directory); a dry run's plan names the file,
    or a ``pkg:`` source this machine lacks, and another machine's cache folder holds the conversion elsewhere."""
    import msgspec

    from engine.record.rundir import config_toml
    from experiments.runner import changed
    from policies import sources

    weights, other = tmp_path / "weights.gguf", tmp_path / "other.gguf"
    weights.write_bytes(b"GGUF weights")
    other.write_bytes(b"GGUF other weights")
    monkeypatch.setenv("MUTUAL_RL_CACHE", str(tmp_path / "cache"))
    run = plan(load_grid(ROOT / "configs/experiments/cpu.toml"))[0]

    def with_model(checkpoint: str, tokenizer: str):
        model = msgspec.structs.replace(run.config.models[0], checkpoint=checkpoint, tokenizer=tokenizer)
        return msgspec.structs.replace(run.config, models=[model, *run.config.models[1:]])

    def saved_as(gguf, root):
        converted = str(sources.resolve(str(gguf), root).directory)  # what a run writes in its config.toml
        (tmp_path / "config.toml").write_bytes(config_toml(with_model(converted, converted)))

    def planned(checkpoint: str):
        return msgspec.structs.replace(run, config=with_model(checkpoint, ""))  # its tokenizer: the checkpoint's

    saved_as(weights, tmp_path / "elsewhere")
    assert not changed(tmp_path, planned(str(weights)))  # the file, converted in another cache folder
    assert changed(tmp_path, planned(str(other)))  # another file
    assert not changed(tmp_path, planned("pkg:not_installed_here/weights.gguf"))  # judged by its name
    assert changed(tmp_path, planned("pkg:not_installed_here/other.gguf"))
    saved_as(other, tmp_path / "cache")
    assert not changed(tmp_path, planned(str(other)))


@pytest.mark.parametrize("text,expected", [
    ('arms = []', "arms: must not be empty"),
    ('arms = ["grpo", "nope"]', "unknown objective"),
    ('arms = ["grpo", "grpo"]', "repeats"),
])
def test_bad_grids_name_the_key(tmp_path, text, expected):
    grid = _grid(tmp_path, tmp_path / "cache").read_text().replace('arms = ["grpo", "sgt_ref"]', text)
    path = tmp_path / "bad.toml"
    path.write_text(grid)
    with pytest.raises(ConfigError, match=expected):
        plan(load_grid(path))
    done = _experiment(str(path), "--dry-run")
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_t_statistics_match_known_values():
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)
    assert t_quantile(0.975, 10) == pytest.approx(2.228139, abs=1e-6)
    e = estimate([1.0, 2.0, 4.0])  # scipy.stats.ttest_1samp: t = 2.6458, p = 0.11808
    assert e.p == pytest.approx(0.118083, abs=1e-6)
    assert (e.low, e.high) == pytest.approx((-1.46125, 6.12792), abs=1e-5)
