"""Mutual RL from Python: several heterogeneous language models post-trained with RL together, sharing experience.

    from mutual_rl import Trainer

    result = Trainer("configs/smoke.toml", train={"steps": 20}).train()
    print(result.status, result.models["gpt2"].accuracy_after, result.run_dir)

``Trainer`` takes what ``launch.py run`` takes (a config, with sections changed by keyword), and what TRL's
``GRPOTrainer`` takes: ``train_dataset=`` (a ``datasets.Dataset``, prompts as strings or chat turns) and
``reward_funcs=`` (functions ``f(prompts, completions, **columns) -> list[float]``, from a script or a
notebook cell, with ``reward_weights=``); ``launch.py run`` is a Trainer. ``resume(run_dir)`` continues a run
as ``launch.py resume`` does. docs/guides/python-api.md has the whole surface.
"""

from engine.config import ConfigError, RunConfig
from mutual_rl.trainer import ModelResult, Trainer, TrainingFailed, TrainResult, resume, save_model

__all__ = ["ConfigError", "ModelResult", "RunConfig", "TrainResult", "Trainer", "TrainingFailed", "resume", "save_model"]
