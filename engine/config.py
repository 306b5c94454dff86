"""The run config: one msgspec Struct tree, decoded strictly from TOML.

Every field has a default that runs on a laptop CPU; configs/default.toml spells
out the ones that matter. Cross-field rules live in ``validate`` (one message each,
saying how to fix it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from engine.configload import ConfigError, load_config
from engine.warmstart import WarmStartConfig
from policies.models import ModelSpec
from policies.objectives import ObjectiveConfig, SGTConfig
from tasks.registry import ArithmeticConfig, TaskConfig


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(ModelSpec, forbid_unknown_fields=True, frozen=True):
    """A model of the run: its spec plus how many workers it gets."""

    generators: int = 1  # generator processes for this model
    lr: float | None = None  # per-model learning rate; None = train.lr
    warmstart_steps: int | None = None  # per-model warm-start length; None = warmstart.steps


class RunSection(_Section):
    name: str = "mutual-rl"
    seed: int = 0
    mode: Literal["async", "sync"] = "async"  # sync: generate, then train, then generate (for comparison)
    max_minutes: float = 14.0  # wall-clock cap of the RL phase; the run ends cleanly when hit
    cache_dir: str = ""  # warm starts and converted tokenizers; "" = $MUTUAL_RL_CACHE or ~/.cache/mutual_rl


class TrainSection(_Section):
    steps: int = 100  # optimizer steps per model
    prompts_per_step: int = 8  # prompt groups per optimizer step (= prompts per batch sent to generators)
    group_size: int = 8  # G: samples per prompt per model
    lr: float = 1e-3
    adam_betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    warmup_steps: int = 0  # linear lr warm-up
    max_new_tokens: int = 12
    temperature: float = 1.0
    max_inflight_batches: int = 2  # prompt batches a model's generators may run ahead of its learner
    peer_deadline_s: float = 5.0  # how long a learner waits for peers' groups on its prompts
    weight_sync_timeout_s: float = 300.0  # a weight broadcast that takes longer fails loudly
    threads_per_process: int = 1


class EvalSection(_Section):
    num_problems: int = 1000  # held-out problems for the accuracy before and after RL
    every_steps: int = 0  # live eval during RL (0 = off)
    live_problems: int = 200  # problems for the live eval
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 250


class RunConfig(_Section):
    run: RunSection = RunSection()
    models: list[ModelConfig] = []
    task: TaskConfig = ArithmeticConfig()
    objective: ObjectiveConfig = SGTConfig()
    train: TrainSection = TrainSection()
    warmstart: WarmStartConfig = WarmStartConfig()
    eval: EvalSection = EvalSection()


def validate(cfg: RunConfig, origin: str) -> RunConfig:
    """Cross-field rules; each failure is one ConfigError naming the key."""
    if not cfg.models:
        raise ConfigError(f"{origin}: models: at least one [[models]] table is required")
    names = [m.name for m in cfg.models]
    for i, name in enumerate(names):
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{origin}: models.{i}.name: {name!r} must be letters, digits, '-' or '_'")
        if names.count(name) > 1:
            raise ConfigError(f"{origin}: models.{i}.name: {name!r} is used twice; names must be unique")
    for i, m in enumerate(cfg.models):
        if m.generators < 1:
            raise ConfigError(f"{origin}: models.{i}.generators: must be >= 1")
        if m.checkpoint is not None and not Path(m.checkpoint).is_dir():
            raise ConfigError(f"{origin}: models.{i}.checkpoint: {m.checkpoint} is not a directory")
    t = cfg.train
    positive = {"train.steps": t.steps, "train.prompts_per_step": t.prompts_per_step,
                "train.group_size": t.group_size, "train.max_new_tokens": t.max_new_tokens,
                "train.max_inflight_batches": t.max_inflight_batches, "eval.num_problems": cfg.eval.num_problems}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{origin}: {key}: must be >= 1, got {value}")
    if t.lr <= 0:
        raise ConfigError(f"{origin}: train.lr: must be > 0, got {t.lr}")
    if t.temperature <= 0:
        raise ConfigError(f"{origin}: train.temperature: must be > 0 for sampling, got {t.temperature}")
    if cfg.objective.kind != "grpo" and len(cfg.models) < 2:
        raise ConfigError(
            f"{origin}: objective.kind: {cfg.objective.kind!r} uses peer experience and needs >= 2 models; "
            "use kind = \"grpo\" for a single model"
        )
    return cfg


def cache_root(cfg: RunConfig) -> Path:
    """Warm starts and converted tokenizers live here, shared by every run on the machine."""
    if cfg.run.cache_dir:
        return Path(cfg.run.cache_dir)
    return Path(os.environ.get("MUTUAL_RL_CACHE") or Path.home() / ".cache" / "mutual_rl")


def tokenizer_cache(cfg: RunConfig) -> str:
    return str(cache_root(cfg) / "tokenizers")


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    return validate(load_config(path, RunConfig, list(overrides)), str(path))
