"""Run a grid's runs one after another, each a ``launch.py run`` of its own, resumably.

A run whose directory holds ``run_result.json`` and no ``FAILED``/``INTERRUPTED`` marker is
finished and never run again, unless the config it ran (its ``config.toml``) is no longer the one
the grid plans for it (an edited base config or grid): then it runs again. Any other directory
left by an earlier attempt (a crash, a Ctrl-C) is removed and the run starts over. Each run's
output goes to ``logs/<id>.log``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import msgspec

from engine.config.schema import cache_root
from engine.record.rundir import config_toml
from experiments.grid import Grid, PlannedRun
from experiments.results import read_run
from mutual_rl.runs import LAUNCH, launch_args
from policies import sources



def code_version(exclude: Path | None = None, root: Path | None = None) -> str:
    """The project's git commit, with "+local-changes" when tracked files differ from it (those under ``exclude``,
    the grid's own results folder, aside: the runner writes them), or "unknown" outside a git checkout."""
    here = root or Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                              timeout=10).stdout.strip()
        top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=here,
                                  timeout=10).stdout.strip() or here).resolve()
        inside = exclude is not None and Path(exclude).resolve().is_relative_to(top)  # git refuses a path outside
        where = ["--", ".", f":(exclude){Path(exclude).resolve()}"] if inside else []
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *where], capture_output=True,
                               text=True, cwd=top, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+local-changes" if dirty else "")) or "unknown"


def recorded_commits(out: Path) -> dict[str, str]:
    """run id -> the code it ran on, from ``commits.txt`` (the last entry of a run wins)."""
    path = out / "commits.txt"
    if not path.exists():
        return {}
    return dict(line.split() for line in path.read_text().splitlines() if len(line.split()) == 2)


def commit_problem(version: str, finished_on: set[str], allow_dirty: bool, allow_mixed: bool) -> str | None:
    """Why a grid must not run its next runs on ``version`` (None: it may). A grid's results are one commit's:
    uncommitted changes would make them no commit's, and finished runs of another commit would mix two."""
    if version.endswith("+local-changes") and not allow_dirty:
        return ("the work tree has uncommitted changes (git status), so the runs could not name the code they ran "
                "on; commit them, or pass --allow-dirty")
    others = sorted(finished_on - {version})
    if others and not allow_mixed:
        commit = others[0].removesuffix("+local-changes")
        return (f"finished runs of this grid ran on {', '.join(others)}, and this is {version}: go on from that "
                f"commit (e.g. git worktree add ../grid {commit}, and run the same command there), or pass "
                "--allow-mixed-commits")
    return None


def run_dir(out: Path, run: PlannedRun) -> Path:
    return out / "runs" / run.id


def finished(path: Path) -> bool:
    return (path / "run_result.json").is_file() and not any((path / m).exists() for m in ("FAILED", "INTERRUPTED"))


def changed(path: Path, run: PlannedRun) -> bool:
    """The run in ``path`` ran another config than the one planned now (the grid or its base was edited since).

    Compared as configs, not as text: a key added to the schema since, at its default, changes nothing the run
    did; a key the schema no longer has, or any value that differs, does."""
    saved = path / "config.toml"
    if not saved.is_file():
        return False
    try:
        ran = msgspec.convert(tomllib.loads(saved.read_text()), type(run.config))
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return True
    return _sources_as_planned(ran, run.config) != run.config


def _sources_as_planned(ran, planned):
    """``ran`` with each model's checkpoint (and the tokenizer taken from it) written as ``planned`` names it,
    where both name the same weights: a run saves its checkpoint resolved (a GGUF file or ``pkg:`` source as
    its converted directory, a Hub id as its snapshot), which a plan made without this machine's checks (a
    dry run), or with another cache folder, writes otherwise."""
    if len(ran.models) != len(planned.models):
        return ran
    root = cache_root(planned)
    models = []
    for r, p in zip(ran.models, planned.models):
        if r.checkpoint and p.checkpoint and r.checkpoint != p.checkpoint and _same_weights(p.checkpoint, r.checkpoint,
                                                                                            root):
            tokenizer = p.tokenizer if r.tokenizer in (r.checkpoint, p.tokenizer) else r.tokenizer
            r = msgspec.structs.replace(r, checkpoint=p.checkpoint, tokenizer=tokenizer)
        models.append(r)
    return msgspec.structs.replace(ran, models=models)


def _same_weights(planned: str, saved: str, root: Path) -> bool:
    """Whether the checkpoint a plan names is the directory a run saved: the same path once resolved, or the
    conversion of the same GGUF file (named by its contents) in any cache folder."""
    saved_dir = Path(saved)
    try:
        source = sources.resolve(planned, root)
    except sources.SourceError:  # not on this machine (a dry run elsewhere): judged by the file's name
        stem = Path(planned.removeprefix(sources.PACKAGE_PREFIX)).stem
        return planned.endswith(".gguf") and saved_dir.parent.name == sources.GGUF_DIR \
            and saved_dir.name.startswith(stem + "-")
    converted = source.gguf is not None or source.directory.parent.name == sources.GGUF_DIR
    return source.directory == saved_dir or (converted and saved_dir.parent.name == sources.GGUF_DIR
                                             and saved_dir.name == source.directory.name)


def is_done(out: Path, run: PlannedRun) -> bool:
    """Finished, on the config planned now: what results count and a resumed grid skips."""
    path = run_dir(out, run)
    return finished(path) and not changed(path, run)


def _state(out: Path, run: PlannedRun) -> str:
    path = run_dir(out, run)
    if not finished(path):
        return "to run"
    return "to run again: its config changed since it ran" if changed(path, run) else "done"


def describe(grid: Grid, runs: list[PlannedRun], out: Path) -> str:
    """The plan, one line a run: what ``--dry-run`` prints."""
    cells = len({(r.task, r.model_set) for r in runs})
    lines = [f"{len(runs)} runs: {len(grid.arms)} arm(s) x {len(grid.seeds)} seed(s) in each of {cells} "
             f"(task, model set) cell(s); results in {out}"]
    states = [_state(out, r) for r in runs]  # each run's saved config read once
    for r, state in zip(runs, states):
        cfg = r.config
        lines.append(f"  {r.id:<40} {', '.join(cfg.names):<22} {cfg.pool.workers} workers on {cfg.pool.device}, "
                     f"{r.samples_per_model:>7,} samples per model{_time_cap(cfg)}  [{state}]")
    todo = sum(state != "done" for state in states)
    lines.append(f"{todo} of {len(runs)} runs to go")
    return "\n".join(lines)


def _time_cap(cfg) -> str:
    """A run that run.max_minutes may end first trains fewer samples than its steps make: the plan says so."""
    return f" or {cfg.run.max_minutes:g} min of RL, whichever is first" if cfg.run.max_minutes else ""


def execute(runs: list[PlannedRun], out: Path) -> tuple[int, list[str]]:
    """Run what is not finished. Returns (runs done now, ids that failed); a Ctrl-C stops at once."""
    done, failed = 0, []
    todo = [r for r in runs if not is_done(out, r)]
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for k, run in enumerate(todo, 1):
        path = run_dir(out, run)
        if path.exists():
            shutil.rmtree(path)  # an earlier attempt that did not finish: start over
        config = out / "configs" / f"{run.id}.toml"
        config.write_bytes(config_toml(run.config))
        print(f"[{k}/{len(todo)}] {run.id}: running (log: {out / 'logs' / run.id}.log)", flush=True)
        with open(out / "commits.txt", "a") as f:  # the code each run ran on, for results.md
            f.write(f"{run.id} {code_version(out)}\n")
        started = time.time()
        with open(out / "logs" / f"{run.id}.log", "wb") as log:
            rc = subprocess.call([sys.executable, str(LAUNCH), *launch_args(config=config, run_dir=path)],
                                 stdout=log, stderr=subprocess.STDOUT)
        if rc in (130, 143):
            raise KeyboardInterrupt
        if rc != 0 or not finished(path):
            failed.append(run.id)
            print(f"[{k}/{len(todo)}] {run.id}: FAILED (exit {rc}); see {out / 'logs' / run.id}.log", flush=True)
            continue
        done += 1
        rows = read_run(path, run)
        gains = ", ".join(f"{r['model']} {100 * r['acc_before']:.1f}% -> {100 * r['acc_after']:.1f}%" for r in rows)
        print(f"[{k}/{len(todo)}] {run.id}: done in {time.time() - started:.0f}s ({gains})", flush=True)
    return done, failed
