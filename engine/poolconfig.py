"""The ``[pool]`` section of a run config: worker pool mode (MWRA on real processes).

A *worker* is one process standing in for one GPU. Its compute budget is fixed by a
cost model: generating one sample of model m takes ``gen_s[m]`` worker-seconds and
training on one sample takes ``train_s[m]``; a worker pads every batch it runs with
sleep up to that cost (real compute is a few percent of it), so eight workers share
two CPU cores without their speeds depending on each other. Costs may change at set
times of the run (``[[pool.phases]]``), which is how a run models response lengths
that drift during RL.

``pool.device`` says where a worker's modules live: "cpu" (the stand-in above) or
"cuda", where worker i takes ``cuda:{i % torch.cuda.device_count()}``: on a GPU box a
worker is a GPU (``worker_device``).

The section is read from the same TOML file as the run config; ``load_pool_run``
splits it off so the lead's ``RunConfig`` stays strict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta

from engine.config import RunConfig, validate
from engine.configload import ConfigError, convert, read_tree
from engine.controller import ControllerConfig, ModelLimits

PosFloat = Annotated[float, Meta(gt=0)]


class CostPhase(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per-sample costs (worker-seconds) from ``from_s`` seconds after the RL start on."""

    from_s: Annotated[float, Meta(ge=0)] = 0.0
    gen_s: dict[str, PosFloat] = {}  # model -> worker-seconds to generate one sample
    train_s: dict[str, PosFloat] = {}  # model -> worker-seconds to train on one sample


class ScriptedMove(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A forced reassignment (tests, demos): at ``at_s`` worker becomes (role, model)."""

    at_s: float
    worker: str
    role: Literal["generator", "learner", "idle"]
    model: str = ""


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    workers: Annotated[int, Meta(ge=2)] = 8  # processes, each one stand-in GPU
    duration_s: PosFloat = 90.0  # wall-clock budget of the RL phase
    mode: Literal["mwra", "static"] = "mwra"  # static: keep static_split for the whole run
    static_split: dict[str, int] = {}  # "generator:<model>" / "learner:<model>" -> workers (static mode)
    phases: list[CostPhase] = msgspec.field(default_factory=lambda: [CostPhase()])  # cost model over time; a model missing from a phase costs 0
    max_inflight_batches: Annotated[int, Meta(ge=1)] = 6  # batches a model may be issued ahead of its learner
    prompts_per_work: Annotated[int, Meta(ge=1)] = 1  # prompts a generator takes per request (a step's batch is split)
    max_model_lead_batches: Annotated[int, Meta(ge=1)] = 4  # ... and ahead of the slowest peer's learner
    tick_s: PosFloat = 1.0  # a waiting learner leader pings its ranks this often (keeps gloo within its time-out)
    group_timeout_s: PosFloat = 120.0  # forming a learner group or a collective that takes longer fails loudly
    peer_dead_after_s: PosFloat = 60.0  # a peer silent this long is declared dead: train solo, say so
    controller_every_s: PosFloat = 1.0  # how often the coordinator calls the controller
    controller: dict[str, float] = {}  # ControllerConfig fields (decision_interval_s, cooldown_s, ...)
    script: list[ScriptedMove] = []  # forced moves on top of (or instead of) the controller
    device: Literal["cpu", "cuda"] = "cpu"  # where workers' modules live; cuda: worker i on cuda:{i % device_count}

    def cost(self, kind: Literal["gen", "train"], model: str, t: float) -> float:
        """Worker-seconds per sample of ``model`` at ``t`` seconds into the run."""
        current = 0.0
        for phase in sorted(self.phases, key=lambda p: p.from_s):
            if phase.from_s <= t:
                current = (phase.gen_s if kind == "gen" else phase.train_s).get(model, 0.0)
        return current


def worker_device(pool: PoolConfig, index: int) -> torch.device:
    """The device of worker ``index``: one GPU per worker (round robin when workers outnumber GPUs)."""
    if pool.device == "cuda":
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


def controller_config(cfg: RunConfig, pool: PoolConfig) -> ControllerConfig:
    """MWRA settings for a pool: per-model limits from the run, time constants from ``pool.controller``."""
    Q = cfg.train.prompts_per_step
    limits = [ModelLimits(name=m.name, group_size=cfg.train.group_size, max_learners=Q) for m in cfg.models]
    cpu_scale = {"decision_interval_s": 5.0, "cooldown_s": 10.0, "min_dwell_s": 15.0, "ewma_halflife_s": 8.0,
                 "min_busy_s": 2.0, "flood_queue_s": 30.0, "drain_horizon_s": 30.0, "stale_stats_s": 20.0}
    try:
        return msgspec.convert({**cpu_scale, **pool.controller, "models": msgspec.to_builtins(limits)},
                               ControllerConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"pool.controller: {exc}") from None


def check(cfg: RunConfig, pool: PoolConfig, origin: str) -> PoolConfig:
    names = {m.name for m in cfg.models}
    for i, phase in enumerate(pool.phases):
        for kind in ("gen_s", "train_s"):
            unknown = set(getattr(phase, kind)) - names
            if unknown:
                raise ConfigError(f"{origin}: pool.phases.{i}.{kind}: unknown model(s) {sorted(unknown)}")
    if pool.mode == "static":
        pools = {f"{r}:{m}" for r in ("generator", "learner") for m in names}
        if set(pool.static_split) != pools:
            raise ConfigError(f"{origin}: pool.static_split: must give a count for each of {sorted(pools)}")
        if sum(pool.static_split.values()) != pool.workers or min(pool.static_split.values()) < 1:
            raise ConfigError(f"{origin}: pool.static_split: counts must be >= 1 and sum to pool.workers")
    for i, move in enumerate(pool.script):
        if move.role != "idle" and move.model not in names:
            raise ConfigError(f"{origin}: pool.script.{i}.model: {move.model!r} is not a model of the run")
    if pool.prompts_per_work > cfg.train.prompts_per_step:
        raise ConfigError(f"{origin}: pool.prompts_per_work: {pool.prompts_per_work} exceeds train.prompts_per_step "
                          f"({cfg.train.prompts_per_step}); a work unit is part of one step's batch")
    if 2 * len(names) > pool.workers:
        raise ConfigError(f"{origin}: pool.workers: {len(names)} models need at least {2 * len(names)} workers")
    if pool.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f'{origin}: pool.device: "cuda" needs a CUDA device and torch sees none; use "cpu"')
    controller_config(cfg, pool)  # validates pool.controller
    return pool


def load_pool_run(path: str | Path, overrides: list[str] = ()) -> tuple[RunConfig, PoolConfig]:
    """Read one TOML file into (RunConfig, PoolConfig); ``--set pool.x=...`` reaches the pool section."""
    path = Path(path)
    tree = read_tree(path, overrides)
    pool_tree = tree.pop("pool", {})
    cfg = validate(convert(tree, RunConfig, str(path)), str(path))
    pool = convert({"pool": pool_tree}, _PoolFile, str(path)).pool
    return cfg, check(cfg, pool, str(path))


class _PoolFile(msgspec.Struct, forbid_unknown_fields=True):
    pool: PoolConfig = PoolConfig()
