"""An experiment grid: arms (objectives) x seeds x model sets x tasks, each cell one engine run.

A grid file is TOML:

    base = "configs/default.toml"        # the run config every run starts from
    out = "results/cpu"                   # results directory (runs/ inside it is not for git)
    arms = ["grpo", "sgt_ref", "prp", "xgrpo", "sgt"]
    seeds = [0, 1, 2]
    set = ["train.steps=100"]             # --set overrides for every run

    [[model_sets]]
    name = "pair"
    models = [{name = "gpt2", arch = "gpt2", tokenizer = "gpt2"}, ...]
    set = ["pool.workers=6"]              # overrides for this model set's runs

    [[tasks]]
    name = "countdown"
    task = {kind = "countdown", n_numbers = 3}
    set = ["train.max_new_tokens=10"]     # overrides for this task's runs
    model_sets = ["pair"]                 # only these model sets on this task (default: all)

Every run of a grid gets the same budget (steps x prompts per step x G samples per model)
and the same hyper-parameters: only ``objective.kind`` (and the objective's own fields,
which keep their defaults) and ``run.seed`` differ between the arms of a cell. The warm
start is the base config's, the same for every arm and seed: the arms of a seed start
from the same weights, so their gains compare pairwise.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated

import msgspec

from engine.config import ConfigError, Origin, RunConfig, config_from_tree
from engine.config.load import apply_override, config_path, convert, parse_override, read_toml

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")]


class ModelSet(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Name
    models: list[dict]  # [[models]] tables of a run config
    set: list[str] = []  # --set overrides for this model set's runs (e.g. pool.workers)


class TaskSetting(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Name
    task: dict  # a run config's [task] table
    set: list[str] = []  # --set overrides for this task's runs
    model_sets: list[str] = []  # the model sets run on this task; empty: all of them


class Grid(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    base: str
    out: str
    arms: list[str]
    seeds: list[int]
    model_sets: list[ModelSet]
    tasks: list[TaskSetting]
    set: list[str] = []
    baseline: str = "grpo"  # solo training: what every arm is compared with
    control: str = "sgt_ref"  # solo plus the answer key: what sharing must beat to add anything


class PlannedRun(msgspec.Struct, frozen=True):
    id: str  # <task>-<model set>-<arm>-s<seed>
    task: str
    model_set: str
    arm: str
    seed: int
    config: RunConfig

    @property
    def samples_per_model(self) -> int:
        t = self.config.train
        return t.steps * t.prompts_per_step * t.group_size


def load_grid(path: str | Path, out: str | None = None) -> Grid:
    """Read a grid file; ``out`` replaces its results directory. Errors name the file and the key."""
    path = config_path(path)  # a path, or a shipped grid's name ("experiments/cpu")
    raw = read_toml(path, "experiment file")
    if out is not None:
        raw["out"] = out
    grid = convert(raw, Grid, Origin(path))
    for key in ("arms", "seeds", "model_sets", "tasks"):
        if not getattr(grid, key):
            raise ConfigError(f"{path}: {key}: must not be empty")
    for key, names in (("arms", grid.arms), ("seeds", grid.seeds), ("model_sets", [m.name for m in grid.model_sets]),
                       ("tasks", [t.name for t in grid.tasks])):
        if len(set(names)) != len(names):
            raise ConfigError(f"{path}: {key}: {names} repeats a value")
    from policies.objectives import objective_names

    for arm in grid.arms:
        if arm not in objective_names():
            raise ConfigError(f"{path}: arms: unknown objective {arm!r}; registered: {', '.join(objective_names())}")
    known = [m.name for m in grid.model_sets]
    for i, task in enumerate(grid.tasks):
        for name in task.model_sets:
            if name not in known:
                raise ConfigError(f"{path}: tasks.{i}.model_sets: {name!r} is not a model set ({', '.join(known)})")
    return grid


def plan(grid: Grid, check_machine: bool = True) -> list[PlannedRun]:
    """Every run of the grid with its resolved config; a bad cell is a ConfigError naming the run."""
    base = read_toml(config_path(grid.base), "base config (the grid's `base`)")
    runs = []
    # Cell by cell (model set, then task), and within a cell seed by seed with every arm: a grid
    # stopped half-way leaves whole cells and whole seeds, whose arms compare pairwise.
    for model_set in grid.model_sets:
        for task in [t for t in grid.tasks if not t.model_sets or model_set.name in t.model_sets]:
            for seed in grid.seeds:
                for arm in grid.arms:
                    run_id = f"{task.name}-{model_set.name}-{arm}-s{seed}"
                    flags = [*grid.set, *model_set.set, *task.set, f"objective.kind={arm}", f"run.seed={seed}"]
                    tree = copy.deepcopy(base)
                    tree["task"], tree["models"] = dict(task.task), [dict(m) for m in model_set.models]
                    origin = Origin(f"{grid.base} (run {run_id})", [])
                    for text in flags:
                        key, value = parse_override(text)
                        apply_override(tree, key, value, text)
                        origin.overrides.append((key, f"--set {text}"))
                    try:
                        cfg = config_from_tree(tree, origin, check_machine, quiet=True)
                    except ConfigError as exc:
                        raise ConfigError(f"run {run_id}: {exc}") from None
                    runs.append(PlannedRun(run_id, task.name, model_set.name, arm, seed, cfg))
    return runs
