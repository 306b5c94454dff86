"""TRL's words for what a run config holds: every field of TRL 1.16's ``GRPOConfig`` (its own and those it takes
from ``transformers.TrainingArguments``) and the ``GRPOTrainer`` arguments ``Trainer`` lacks, each with this
project's key for the same thing, or ``None`` and why there is none.

An unknown config key (``engine.config.load.convert``) or ``Trainer`` keyword (``mutual_rl.trainer``) that is
one of these names is answered with the key here instead of a spelling guess. docs/guides/from-trl.md is the
same table to read; tests/test_trl_names.py keeps the two, and the installed ``GRPOConfig``, in step.
"""

from __future__ import annotations

from typing import NamedTuple


class TrlName(NamedTuple):
    """This project's name for one of TRL's."""

    here: str | None  # a config key ("train.lr", "models.N.lr" per model) or Trainer argument; None: no equivalent
    note: str = ""  # what differs, or why there is none


_SAMPLING = ("generators sample at train.temperature, train.top_p and train.top_k alone, so the learner's log-probs "
             "are the sampler's")
_ENTROPY = "no entropy term in the loss"
_LOGGED = "every sample is in the run's experience log; the monitor shows each prompt's samples"
_SGLANG = "sglang, not vLLM"

_ONE_BY_ONE: dict[str, TrlName] = {
    # GRPOTrainer's arguments (reward_funcs, train_dataset, eval_dataset, callbacks: Trainer's own)
    "args": TrlName("the config", "a TOML path or dict as Trainer's first argument, or its sections as keywords: "
                    "Trainer(config, train={'group_size': 8}, objective={'kl_coef': 0.04})"),
    "model": TrlName("models.N.checkpoint", "one [[models]] table per model; several train together"),
    "processing_class": TrlName("models.N.tokenizer", "'' = the checkpoint's own"),
    "peft_config": TrlName("models.N.lora", "a table: rank, alpha, dropout, targets"),
    "optimizers": TrlName(None, "each learner builds its AdamW (train.lr, train.adam_betas)"),
    "reward_funcs": TrlName("reward.funcs", "or Trainer(reward_funcs=...)"),
    "reward_processing_classes": TrlName(None, "a reward function receives text"),
    "train_dataset": TrlName("task.path", "with task.kind = 'dataset', or Trainer(train_dataset=...)"),
    "eval_dataset": TrlName("task.eval_path", "or Trainer(eval_dataset=...)"),
    "quantization_config": TrlName(None, "weights train in fp32 or bf16"),
    "tools": TrlName(None, "completions are single-turn text"),
    "rollout_func": TrlName(None, "generators sample completions themselves"),
    "environment_factory": TrlName(None, "a task (task.kind) makes the prompts and checks the answers"),
    # GRPOConfig's own fields
    "model_init_kwargs": TrlName(None, "a checkpoint loads as it was saved"),
    "trust_remote_code": TrlName(None, "models are the families the installed transformers knows (models.N.arch)"),
    "router_aux_loss_coef": TrlName(None, "no MoE auxiliary loss"),
    "disable_dropout": TrlName(None, "no switch"),
    "cast_lm_head_to_fp32": TrlName(None, "train.mixed_precision = 'fp32' (the default) keeps every weight fp32"),
    "num_generations": TrlName("train.group_size", "G samples per prompt, per model"),
    "num_generations_eval": TrlName(None, "an evaluation scores one completion per problem"),
    "max_completion_length": TrlName("train.max_new_tokens", "eval.max_new_tokens for evaluations"),
    "ds3_gather_for_generation": TrlName(None, "no DeepSpeed; generators hold whole weights"),
    "shuffle_dataset": TrlName("task.seed", "it shuffles the training order"),
    "pad_to_multiple_of": TrlName(None, "padding is the engine's"),
    "generation_batch_size": TrlName("train.prompts_per_step", "x train.group_size samples per step; "
                                     "pool.prompts_per_work splits a step into work units"),
    "steps_per_generation": TrlName(None, "generators run up to train.max_inflight_steps ahead instead"),
    "temperature": TrlName("train.temperature", "eval.temperature for evaluations (0 = greedy)"),
    "top_p": TrlName("train.top_p", "generators only; log-probs are of the truncated distribution; not with sglang"),
    "top_k": TrlName("train.top_k", "0 = off; generators only; not with sglang"),
    "min_p": TrlName(None, _SAMPLING),
    "repetition_penalty": TrlName(None, _SAMPLING),
    "generation_kwargs": TrlName(None, _SAMPLING),
    "chat_template_kwargs": TrlName(None, "each model's own chat template formats the prompt (models.N.prompt)"),
    "cache_implementation": TrlName("models.N.generation.backend", "'hf-static': a static KV cache"),
    "use_vllm": TrlName("models.N.generation.backend", f"'sglang': {_SGLANG}"),
    "vllm_mode": TrlName("models.N.generation.sglang_url",
                         f"a server's URL, or '' for an Engine in the worker; {_SGLANG}"),
    "vllm_server_base_url": TrlName("models.N.generation.sglang_url", _SGLANG),
    "vllm_server_host": TrlName("models.N.generation.sglang_url", _SGLANG),
    "vllm_server_port": TrlName("models.N.generation.sglang_url", _SGLANG),
    "vllm_gpu_memory_utilization": TrlName("models.N.generation.sglang_memory", _SGLANG),
    "vllm_max_model_length": TrlName("models.N.generation.sglang_args", "sglang's context_length"),
    "vllm_model_impl": TrlName(None, _SGLANG),
    "vllm_enable_sleep_mode": TrlName(None, f"{_SGLANG}; a generator worker keeps its engine"),
    "vllm_structured_outputs_regex": TrlName(None, _SAMPLING),
    "vllm_server_timeout": TrlName(None, _SGLANG),
    "vllm_group_port": TrlName(None, "weights reach the generators by pool.weights"),
    "vllm_tensor_parallel_size": TrlName(None, "a generator is one worker on one GPU"),
    "beta": TrlName("objective.kl_coef", "a k3 KL to the model's starting weights"),
    "num_iterations": TrlName(None, "one optimizer step per batch; generation runs ahead asynchronously instead"),
    "epsilon": TrlName("objective.eps_low", "default 0.2"),
    "epsilon_high": TrlName("objective.eps_high", "default 0.28 (clip-higher)"),
    "delta": TrlName(None, "no two-sided clipping"),
    "sapo_temperature_neg": TrlName(None, "no SAPO loss (objective.kind lists the objectives)"),
    "sapo_temperature_pos": TrlName(None, "no SAPO loss (objective.kind lists the objectives)"),
    "vespo_k_pos": TrlName(None, "no VESPO loss (objective.kind lists the objectives)"),
    "vespo_lambda_pos": TrlName(None, "no VESPO loss (objective.kind lists the objectives)"),
    "vespo_k_neg": TrlName(None, "no VESPO loss (objective.kind lists the objectives)"),
    "vespo_lambda_neg": TrlName(None, "no VESPO loss (objective.kind lists the objectives)"),
    "importance_sampling_level": TrlName(None, "ratios are per token"),
    "reward_weights": TrlName("reward.weights", "or Trainer(reward_weights=...)"),
    "multi_objective_aggregation": TrlName(None, "rewards are summed with reward.weights, then normalised per group"),
    "scale_rewards": TrlName("objective.std_normalise", "per group; 'batch': none"),
    "loss_type": TrlName("objective.aggregation", "'dapo' / 'grpo' = 'token_mean' / 'seq_mean'; "
                         "'dr_grpo': objective.std_normalise = false"),
    "mask_truncated_completions": TrlName(None, "cut completions are trained and counted"),
    "sync_ref_model": TrlName(None, "the reference stays the starting weights"),
    "ref_model_mixup_alpha": TrlName(None, "the reference stays the starting weights"),
    "ref_model_sync_steps": TrlName(None, "the reference stays the starting weights"),
    "top_entropy_quantile": TrlName(None, _ENTROPY),
    "entropy_coef": TrlName(None, _ENTROPY),
    "use_adaptive_entropy": TrlName(None, _ENTROPY),
    "entropy_coef_min": TrlName(None, _ENTROPY),
    "entropy_coef_max": TrlName(None, _ENTROPY),
    "entropy_coef_delta": TrlName(None, _ENTROPY),
    "entropy_target": TrlName(None, _ENTROPY),
    "max_tool_calling_iterations": TrlName(None, "completions are single-turn text"),
    "vllm_importance_sampling_correction": TrlName("objective.behav_weight_cap", "the behaviour policy's weight, "
                                                   "always on, truncated there"),
    "vllm_importance_sampling_clip_max": TrlName("objective.behav_weight_cap"),
    "vllm_importance_sampling_cap": TrlName("objective.behav_weight_cap"),
    "vllm_importance_sampling_mode": TrlName(None, "the weight is truncated, never masked"),
    "vllm_importance_sampling_clip_min": TrlName(None, "the weight is capped above only"),
    "off_policy_mask_threshold": TrlName(None, "stale samples are masked instead (objective.max_staleness)"),
    "use_bias_correction_kl": TrlName(None, "the KL term is objective.kl_coef's k3, as it stands"),
    "log_completions": TrlName(None, _LOGGED),
    "log_multimodal": TrlName(None, _LOGGED),
    "num_completions_to_print": TrlName(None, _LOGGED),
    "log_unique_prompts": TrlName(None, _LOGGED),
    "log_completions_hub_repo": TrlName(None, _LOGGED),
    "use_transformers_continuous_batching": TrlName("models.N.generation.backend", "'hf', 'hf-static' or 'sglang'"),
    "transformers_continuous_batching_config": TrlName("models.N.generation.backend", "'hf', 'hf-static' or 'sglang'"),
    "use_transformers_paged": TrlName("models.N.generation.backend", "'hf', 'hf-static' or 'sglang'"),
    # transformers.TrainingArguments' fields a GRPO user sets
    "output_dir": TrlName("run_dir", "the run directory: launch.py run --run-dir, Trainer(run_dir=...)"),
    "learning_rate": TrlName("train.lr", "models.N.lr per model"),
    "per_device_train_batch_size": TrlName("train.prompts_per_step", "prompts per optimizer step, each with "
                                           "train.group_size samples; TRL counts completions per device"),
    "max_steps": TrlName("train.steps", "run.max_minutes caps the wall clock"),
    "num_train_epochs": TrlName(None, "train.steps counts optimizer steps: epochs x rows / train.prompts_per_step"),
    "warmup_steps": TrlName("train.warmup_steps", "linear, then constant"),
    "lr_scheduler_type": TrlName(None, "linear warm-up (train.warmup_steps), then constant"),
    "lr_scheduler_kwargs": TrlName(None, "linear warm-up (train.warmup_steps), then constant"),
    "optim": TrlName(None, "AdamW"),
    "optim_args": TrlName(None, "AdamW"),
    "adam_beta1": TrlName("train.adam_betas", "[beta1, beta2]"),
    "adam_beta2": TrlName("train.adam_betas", "[beta1, beta2]"),
    "adam_epsilon": TrlName(None, "AdamW's default"),
    "weight_decay": TrlName(None, "none in RL; warmstart.weight_decay for the warm start"),
    "gradient_accumulation_steps": TrlName("train.grad_accum", "micro-batches of one step"),
    "max_grad_norm": TrlName("train.grad_clip"),
    "bf16": TrlName("train.mixed_precision", "'bf16' (fsdp2); models.N.generation.dtype for sampling"),
    "fp16": TrlName(None, "learners train in bf16 or fp32; models.N.generation.dtype = 'float16' samples in it"),
    "gradient_checkpointing": TrlName("train.activation_checkpointing", "fsdp2"),
    "activation_checkpointing": TrlName("train.activation_checkpointing", "fsdp2"),
    "fsdp": TrlName("train.sharding", "'fsdp2'"),
    "fsdp_config": TrlName("train.sharding", "'fsdp2'"),
    "deepspeed": TrlName(None, "learners shard with train.sharding = 'fsdp2' instead"),
    "seed": TrlName("run.seed", "warmstart.seed for the warm start"),
    "data_seed": TrlName("task.seed"),
    "full_determinism": TrlName(None, "run.mode = 'sync' with run.seed is the closest"),
    "use_cpu": TrlName("pool.device", "'cpu'"),
    "logging_steps": TrlName(None, "every learner step is logged (RUN_DIR/metrics.jsonl)"),
    "logging_strategy": TrlName(None, "every learner step is logged (RUN_DIR/metrics.jsonl)"),
    "logging_first_step": TrlName(None, "every learner step is logged (RUN_DIR/metrics.jsonl)"),
    "report_to": TrlName("run.wandb", "and run.tensorboard"),
    "run_name": TrlName("run.name"),
    "project": TrlName(None, "the W&B project is $WANDB_PROJECT (default mutual-rl)"),
    "disable_tqdm": TrlName("quiet", "Trainer(quiet=True): no live display"),
    "eval_strategy": TrlName("eval.every_steps", "0 = no live evaluation"),
    "eval_steps": TrlName("eval.every_steps", "eval.live_problems problems each"),
    "eval_on_start": TrlName(None, "every run evaluates before RL and after (eval.num_problems)"),
    "per_device_eval_batch_size": TrlName("eval.batch_size"),
    "save_strategy": TrlName("run.checkpoint_every", "0: at the end only"),
    "save_steps": TrlName("run.checkpoint_every"),
    "save_total_limit": TrlName("run.keep_checkpoints"),
    "resume_from_checkpoint": TrlName(None, "launch.py resume RUN_DIR, or mutual_rl.resume(run_dir)"),
    "auto_find_batch_size": TrlName(None, "run.memory_check refuses a run that will not fit, before it starts"),
    "remove_unused_columns": TrlName(None, "every column reaches the reward functions"),
}

# the rest of TrainingArguments: settings of transformers.Trainer's own loop, which runs no part of a run here
_NO_EQUIVALENT: dict[str, tuple[str, ...]] = {
    "no Hub upload": (
        "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
        "hub_revision"),
    "learners run their own data-parallel groups (train.sharding)": (
        "ddp_backend", "ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_find_unused_parameters",
        "ddp_static_graph", "ddp_timeout", "local_rank", "parallelism_config", "accelerator_config",
        "average_tokens_across_devices", "save_on_each_node", "log_on_each_node"),
    "the task hands out prompts; no dataloader": (
        "dataloader_drop_last", "dataloader_in_order", "dataloader_multiprocessing_context",
        "dataloader_num_workers", "dataloader_persistent_workers", "dataloader_pin_memory",
        "dataloader_prefetch_factor", "train_sampling_strategy", "length_column_name", "ignore_data_skip",
        "label_names"),
    "an evaluation is held-out accuracy (eval.*), not a loss or a metric function": (
        "eval_delay", "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object",
        "prediction_loss_only", "include_for_metrics", "batch_eval_metrics", "metric_for_best_model",
        "greater_is_better", "load_best_model_at_end", "bf16_full_eval", "fp16_full_eval"),
    "not a setting here": (
        "optim_target_modules", "tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode",
        "use_liger_kernel", "liger_kernel_config", "use_cache", "neftune_noise_alpha", "label_smoothing_factor",
        "torch_empty_cache_steps", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
        "save_only_model", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
        "include_num_input_tokens_seen", "logging_nan_inf_filter", "log_level", "log_level_replica",
        "skip_memory_metrics", "debug", "do_train", "do_eval", "do_predict", "trackio_space_id",
        "trackio_bucket_id", "trackio_static_space_id"),
}

TRL_NAMES: dict[str, TrlName] = {
    **_ONE_BY_ONE, **{name: TrlName(None, note) for note, names in _NO_EQUIVALENT.items() for name in names}}


def trl_hint(name: str) -> str | None:
    """"TRL's NAME is KEY here (NOTE)", or "TRL's NAME has no equivalent here: NOTE"; None for a name TRL lacks."""
    entry = TRL_NAMES.get(name)
    if entry is None:
        return None
    if entry.here is None:
        return f"TRL's {name} has no equivalent here: {entry.note}"
    return f"TRL's {name} is {entry.here} here" + (f" ({entry.note})" if entry.note else "")
