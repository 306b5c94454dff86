"""``launch.py experiment GRID``: plan, run (resumably) and summarise a grid of runs."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="run a grid of runs (objectives x seeds x model sets x tasks) and "
                                          "write results.csv, results.md and plots")
    p.add_argument("grid", help="experiment TOML, e.g. configs/experiments/cpu.toml")
    p.add_argument("--out", default=None, help="results directory (default: the grid's `out`)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (runs, workers, samples) and exit")
    p.add_argument("--report-only", action="store_true", help="rebuild the results files from finished runs")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run with uncommitted changes (the results then name no commit)")
    p.add_argument("--allow-mixed-commits", action="store_true",
                   help="go on with finished runs that ran on another commit")
    p.set_defaults(handler=experiment_command)


def experiment_command(args: argparse.Namespace) -> int:
    from engine.config import ConfigError
    from experiments.grid import load_grid, plan
    from experiments.runner import describe, execute

    try:
        grid = load_grid(args.grid, args.out)
        runs = plan(grid, check_machine=not args.dry_run)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(grid.out)
    print(describe(grid, runs, out), flush=True)
    if args.dry_run:
        missing = _missing_here(runs)
        if missing:
            print("needed on the machine that runs it (absent here): " + "; ".join(missing))
        problem = _arch_problem(runs)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        return 0
    try:
        _preflight(runs)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.report_only and (problem := _commit_problem(args, runs, out)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    failed: list[str] = []
    _stop_on_signals()
    try:
        if not args.report_only:
            _, failed = execute(runs, out)
    except KeyboardInterrupt:
        print("interrupted: finished runs are kept; run the same command again to go on", file=sys.stderr)
        return 130
    written = write_results(grid, runs, out, f"python launch.py experiment {args.grid}"
                                             + (f" --out {args.out}" if args.out else ""))
    print("wrote " + ", ".join(str(p) for p in written))
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; run the command again to retry them",
              file=sys.stderr)
        return 1
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C and a scheduler's SIGTERM stop the grid at once, as they stop a run (its own coordinator saves the
    run's checkpoints), even where this process started with them ignored (a background job of a script)."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _preflight(runs) -> None:
    """Tokenizers and tasks of every distinct cell load, before an hour of runs starts."""
    from engine.session import preflight

    seen = set()
    for r in runs:
        if (r.task, r.model_set) not in seen:
            seen.add((r.task, r.model_set))
            preflight(r.config)


def _missing_here(runs) -> list[str]:
    from engine.config import cache_root
    from policies.sources import SourceError, resolve

    missing = []
    for r in runs:
        for m in r.config.models:  # a GGUF file, a package's file, a Hub id: found as the run will find them
            try:
                source = resolve(m.checkpoint, cache_root(r.config)) if m.checkpoint else None
            except SourceError:
                missing.append(m.checkpoint)
                continue
            if source is not None and source.gguf is None and not source.directory.exists():
                missing.append(m.checkpoint)
        paths = [m.tokenizer for m in r.config.models if "/" in m.tokenizer]
        task = r.config.task
        paths += [p for p in (getattr(task, "path", None), getattr(task, "eval_path", None)) if p]
        missing += [p for p in paths if not Path(p).exists()]
        if r.config.pool.device == "cuda" and "a CUDA device" not in missing:
            import torch

            if not torch.cuda.is_available():
                missing.append("a CUDA device")
    return list(dict.fromkeys(missing))


def _arch_problem(runs) -> str | None:
    """The first model whose checkpoint, where it is here, is not the ``arch`` its config says (loading it in a
    run would fail after the run's start), read with transformers' own config loader."""
    from transformers import AutoConfig

    for r in runs:
        for m in r.config.models:
            if m.checkpoint and (Path(m.checkpoint) / "config.json").is_file():
                try:
                    found = AutoConfig.from_pretrained(m.checkpoint).model_type
                except (OSError, ValueError) as exc:
                    return f"{m.checkpoint}: transformers cannot read its config.json ({exc})"[:300]
                if m.arch and found != m.arch:
                    return f"model {m.name!r}: {m.checkpoint} is a {found!r} model but its arch is {m.arch!r}"
    return None


def write_results(grid, runs, out: Path, command: str) -> list[Path]:
    """results.csv, curves.csv, results.md and the plots, from every finished run of the grid."""
    from experiments import plots
    from experiments.results import curves, read_run, write_csv
    from experiments.runner import is_done
    from experiments.runner import run_dir
    from experiments.summary import write_markdown

    done = [r for r in runs if is_done(out, r)]
    rows = [row for r in done for row in read_run(run_dir(out, r), r)]
    write_csv(out / "results.csv", rows)
    points = [dict(task=r.task, model_set=r.model_set, arm=r.arm, seed=r.seed, **p)
              for r in done for p in curves(run_dir(out, r), r)]
    _write_points(out / "curves.csv", points)
    header = [f"# Experiment results: {Path(grid.out).name}", "",
              f"Reproduce: `{command}` (code: {_commits(out, done)}); {len(done)} of {len(runs)} runs finished.",
              f"Base config `{grid.base}` with {', '.join(f'`--set {s}`' for s in grid.set) or 'no overrides'}; "
              f"arms {', '.join(grid.arms)}; seeds {', '.join(map(str, grid.seeds))}. "
              f"`{grid.baseline}` is solo training, `{grid.control}` is solo plus the task's reference solution "
              "on the prompts where every own sample failed (the answer-key control). Every figure below is "
              "computed from results.csv; intervals are Student-t over seeds (95%), not corrected for the number of "
              "comparisons: a cell makes a dozen or more, so about one in twenty may exclude 0 by chance alone.", ""]
    (out / "results.md").write_text(write_markdown(_read_back(out), grid.arms, grid.baseline, grid.control, header))
    return [out / "results.csv", out / "curves.csv", out / "results.md",
            *plots.learning_curves(points, grid.arms, out), *plots.gains(_read_back(out), grid.arms, out)]


def _read_back(out: Path) -> list[dict]:
    from experiments.results import read_csv

    return read_csv(out / "results.csv")


def _write_points(path: Path, points: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "model_set", "arm", "seed", "model", "samples", "accuracy"])
        writer.writeheader()
        writer.writerows(points)


def _commit_problem(args: argparse.Namespace, runs, out: Path) -> str | None:
    """Why the grid's next runs must not run on this code (None: they may): see ``runner.commit_problem``."""
    from experiments.runner import code_version, commit_problem, is_done, recorded_commits

    done = [r for r in runs if is_done(out, r)]  # each run's saved config read once
    if len(done) == len(runs):
        return None  # nothing to run: the results are rebuilt from what ran
    ran = recorded_commits(out)
    finished_on = {ran[r.id] for r in done if r.id in ran}
    return commit_problem(code_version(out), finished_on, args.allow_dirty, args.allow_mixed_commits)


def _commits(out: Path, done) -> str:
    """The commits the finished runs ran on (``commits.txt``, written by the runner; the last entry of a run wins)."""
    from experiments.runner import code_version, recorded_commits

    ran = recorded_commits(out)
    commits = sorted({ran[r.id] for r in done if r.id in ran})
    return ", ".join(f"commit {c}" for c in commits) if commits else f"commit {code_version()} (when reported)"
