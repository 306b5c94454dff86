"""Mutual RL from Python: several heterogeneous language models post-trained with RL together, sharing experience.

    from mutual_rl import Trainer

    result = Trainer("smoke", train={"steps": 20}).train()
    print(result.status, result.models["gpt2"].accuracy_after, result.run_dir)

``Trainer`` takes what ``launch.py run`` takes (a config, with sections changed by keyword), and what TRL's
``GRPOTrainer`` takes: ``train_dataset=`` (a ``datasets.Dataset``, prompts as strings or chat turns) and
``reward_funcs=`` (functions ``f(prompts, completions, **columns) -> list[float]``, from a script or a
notebook cell, with ``reward_weights=``) and ``callbacks=`` (``TrainerCallback``s, which may stop the run). The
config is a file, a shipped config's name ("smoke") or typed (``RunConfig(train=TrainSection(steps=20), ...)``);
``launch.py run`` runs what a Trainer runs (``mutual_rl.runs``, a run's one home). ``resume(run_dir)`` continues
a run as ``launch.py resume`` does. docs/guides/python-api.md has the whole surface.
"""

from engine.config import ConfigError, RunConfig
from engine.config.schema import (EvalSection, GenerationConfig, ModelConfig, PoolSection, RewardSection, RunSection,
                                  TimeoutSection, TrainSection, WarmStartConfig)
from mutual_rl.callbacks import EvalRecord, StepRecord, TrainerCallback, TrainerControl
from mutual_rl.trainer import ModelResult, Trainer, TrainingFailed, TrainResult, resume, save_model

__all__ = ["ConfigError", "EvalRecord", "EvalSection", "GenerationConfig", "ModelConfig", "ModelResult", "PoolSection",
           "RewardSection", "RunConfig", "RunSection", "StepRecord", "TimeoutSection", "TrainResult", "TrainSection",
           "Trainer", "TrainerCallback", "TrainerControl", "TrainingFailed", "WarmStartConfig", "resume", "save_model"]
