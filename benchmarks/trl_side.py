"""TRL's side of ``benchmarks.trl_compare``: TRL 1.16's GRPOTrainer on a run config's first model, set to do what
this project's solo GRPO learner does, in a process of its own.

    python -m benchmarks.trl_side CONFIG RESULT_JSON MODEL_DIR [--threads N]

It trains, saves the final model (``policies.models.save_policy``: safetensors, float32) into MODEL_DIR for
``benchmarks.trl_compare`` to score beside this project's final checkpoint, and writes its figures to RESULT_JSON.
It evaluates nothing itself.

What ``trl_args`` sets, and why, read in TRL 1.16's ``trainer/grpo_config.py``, ``trainer/base_config.py`` and
``trainer/grpo_trainer.py`` (transformers 5.24's ``training_args.py``):

- precision: ``_BaseConfig`` defaults ``bf16=True`` (unless fp16) and ``gradient_checkpointing=True``; on a CPU
  the first trains under bf16 autocast, the second pays a second forward pass per step. Both off: float32 and no
  recomputation, as this project's learner (``train.activation_checkpointing`` is fsdp2's only). transformers 5.24
  renamed the second ``activation_checkpointing`` (the old name fills it only when it is unset): both are set.
  With bf16 TRL would also cast the model to bf16 for continuous-batching generation; that path is off too.
- prompt order: ``shuffle_dataset`` (default True) makes ``RepeatSampler`` draw a seeded permutation; False walks
  the rows in index order, ``Q = prompts_per_step`` rows a step, each repeated ``G = group_size`` times: step k
  trains on problems kQ .. kQ+Q-1, the units this project's dispatcher hands out (``task.problem(i)``).
- one generation per optimizer step, used once: ``steps_per_generation=1`` (default: gradient_accumulation_steps,
  1), ``num_iterations=1`` (so TRL's ratio is 1 and its clip never binds: TRL is strictly on-policy, while this
  project's async mode may train on samples up to ``max_inflight_steps`` versions old, importance-weighted).
- sampling: ``top_p=1.0``, ``top_k=0``, ``min_p=None``, ``repetition_penalty=1.0`` (TRL's defaults, written out:
  TRL passes them over the model's own generation config) are plain sampling at ``train.temperature``, this
  project's generator. TRL stops at the tokenizer's EOS and every ``eos_token_id`` of the model's generation
  config (and masks what follows); this project at ``policies.templates.end_ids`` (EOS, and with a model's
  ``end = "newline"`` every line-break token), so the child sets the model's generation config to those.
  ``use_vllm`` and ``use_transformers_continuous_batching`` off: ``model.generate``. ``mask_truncated_completions``
  off: a cut completion is scored and trained on, as here.
- optimizer: transformers' default ``optim`` with torch >= 2.8 is ``adamw_torch_fused``, this project's
  ``torch.optim.AdamW(fused=True)``; eps 1e-8 both; weight decay 0; betas, clip and learning rate from the config.
  The lr is constant; with ``train.warmup_steps`` W > 0 TRL's ``constant_with_warmup`` ramps from 0 at step 0
  where this project's starts at 1/W (one step apart).
- objective: ``beta`` = ``kl_coef``, ``epsilon``/``epsilon_high`` = ``eps_low``/``eps_high``, ``loss_type``
  ``dapo`` (a token mean over the step's batch) for ``token_mean`` and ``grpo`` (per-sequence means, averaged)
  for ``seq_mean``; ``scale_rewards`` ``group``/``none`` for ``std_normalise``. What cannot be set: TRL divides
  by the group's Bessel-corrected std plus 1e-4, this project by the population std plus 1e-6, a constant factor
  sqrt((G-1)/G) on every advantage (0.94 at G = 8) that AdamW all but cancels.
- the model: a ``PreTrainedModel`` instance (``build_policy``, float32), so ``model_init_kwargs`` (``dtype``) is
  not used. ``disable_dropout=True``; ``pad_to_multiple_of`` is None off Neuron; ``cast_lm_head_to_fp32``,
  ``torch_compile`` off (defaults, written out); ``dataloader_drop_last`` is moot (whole steps of rows).
- prompts: a tokenizer with a chat template gets chat rows, which TRL renders with ``apply_chat_template(...,
  add_generation_prompt=True)`` and no added special tokens, as ``policies.templates.prompt_ids``; one without
  (a base model such as Gemma 3 270M) gets the text this project renders (the family's plain template or the
  model's own ``prompt``), which TRL tokenizes with ``tokenizer(text=...)``, adding the tokenizer's own special
  tokens: the BOS the project prepends is written into the text where the tokenizer would not add it
  (``trl_prompt``, which checks that TRL's ids are the project's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

STEPS_WHEN_TIMED = 100_000  # a wall-clock budget: TRL runs until its callback stops it
MAX_ROWS_STEPS = 5_000  # rows for at most this many steps (SmolLM2 takes ~45 in 15 minutes)


def missing_trl() -> str | None:
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return ("the TRL side needs trl and datasets, which are not installed: "
                "pip install -c constraints.txt -e '.[compare]'")
    return None


def trl_steps(cfg) -> int:
    """Optimizer steps TRL is given: the config's with a step budget, else more than the clock allows."""
    return cfg.train.steps if cfg.run.max_minutes >= 24 * 60 else STEPS_WHEN_TIMED


def trl_args(cfg, out_dir: str | os.PathLike) -> dict:
    """``trl.GRPOConfig``'s keyword arguments for the config's first model: this project's solo GRPO step (the
    module docstring says what each setting matches and what does not)."""
    t, m, obj = cfg.train, cfg.models[0], cfg.objective
    return dict(
        output_dir=str(out_dir), use_cpu=True, seed=cfg.run.seed, report_to=[], save_strategy="no", logging_steps=1,
        # float32 without recomputation: TRL's defaults are bf16 autocast and gradient checkpointing (transformers
        # 5.24 reads activation_checkpointing, which takes gradient_checkpointing's value only when left unset)
        bf16=False, fp16=False, gradient_checkpointing=False, activation_checkpointing=False, torch_compile=False,
        cast_lm_head_to_fp32=False,
        # rows in index order, Q prompts x G samples a step, each generation trained on once
        shuffle_dataset=False, max_steps=trl_steps(cfg), per_device_train_batch_size=t.prompts_per_step * t.group_size,
        num_generations=t.group_size, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        dataloader_num_workers=0, dataloader_drop_last=False, remove_unused_columns=False,
        # plain sampling at the project's temperature and length, by model.generate
        max_completion_length=t.max_new_tokens, temperature=t.temperature, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, use_vllm=False, use_transformers_continuous_batching=False,
        mask_truncated_completions=False,
        # AdamW as engine.train.optim's, constant lr (with the project's warm-up length)
        optim="adamw_torch_fused", learning_rate=m.lr or t.lr, adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1], adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=t.grad_clip,
        lr_scheduler_type="constant_with_warmup" if t.warmup_steps else "constant", warmup_steps=t.warmup_steps,
        # the objective's clipped surrogate, normalisation and aggregation
        beta=obj.kl_coef, epsilon=obj.eps_low, epsilon_high=obj.eps_high, importance_sampling_level="token",
        loss_type="dapo" if obj.aggregation == "token_mean" else "grpo",
        scale_rewards="group" if obj.std_normalise else "none", top_entropy_quantile=1.0, disable_dropout=True,
    )


def trl_prompt(tokenizer, fmt, prompt) -> str | list[dict[str, str]]:
    """The ``prompt`` of TRL's row for a problem's prompt (``Problem.prompt``) to a model of format ``fmt`` (a
    family, or ``policies.templates.prompt_format`` of the model): chat turns for a tokenizer with a chat template,
    else the text this project renders, which TRL's ``tokenizer(text=...)`` turns into this project's prompt ids
    (with the BOS token's text in front where the project prepends BOS and the tokenizer does not). ValueError if
    TRL would tokenize it otherwise."""
    from policies.templates import as_format, chat_prompt, format_prompt, plain_question, prompt_ids

    fmt = as_format(fmt)
    want = prompt_ids(tokenizer, fmt, prompt)
    if fmt.template:  # the model's own prompt writes the question (under a chat template: the user turn's text)
        prompt = fmt.template.format(question=plain_question(prompt))
    if chat_prompt(tokenizer, prompt) is not None:
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        # TRL's _tokenize_prompts call
        got = tokenizer.apply_chat_template([turns], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"][0]
        candidates = [(turns, got)]
    else:
        text = prompt if fmt.template else format_prompt(fmt.arch, plain_question(prompt))
        texts = [text, *([tokenizer.bos_token + text] if tokenizer.bos_token else [])]
        candidates = [(c, tokenizer(text=c)["input_ids"]) for c in texts]  # TRL's own call for text prompts
    for row, ids in candidates:
        if list(ids) == want:
            return row
    raise ValueError(f"TRL would tokenize {fmt.arch!r}'s prompt as {list(candidates[0][1])[:8]}..., not this "
                     f"project's {want[:8]}...")


def trl_rows(task, tokenizer, fmt, count: int) -> list[dict]:
    """TRL's dataset: training problems 0..count-1 in order, each with its id for the task's verifier."""
    return [{"prompt": trl_prompt(tokenizer, fmt, task.problem(i).prompt), "prompt_id": i} for i in range(count)]


def wall_clock(budget_s: float):
    """A callback that stops training once ``budget_s`` seconds have passed since it began."""
    from transformers import TrainerCallback

    class WallClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            if time.time() - self.t0 >= budget_s:
                control.should_training_stop = True
            return control

    return WallClock()


def run(config_path: str, out_path: str, model_dir: str, threads: int) -> int:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from engine.config import load_run_config, model_spec, tokenizer_cache
    from policies.models import build_policy, save_policy
    from policies.templates import end_ids, prompt_format
    from engine.config import run_task
    from tasks.rewards import TaskReward
    from tokenbridge import load_tokenizer

    cfg = load_run_config(config_path)
    t = cfg.train
    torch.set_num_threads(threads)
    spec = model_spec(cfg.models[0])
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    fmt = prompt_format(spec)
    model = build_policy(spec, tokenizer)
    # stop where this project's generator stops: EOS (and a base model's line breaks with end = "newline")
    model.generation_config.eos_token_id = list(end_ids(tokenizer, fmt.end))
    task = run_task(cfg)  # the reward this project's workers pay
    rows = trl_rows(task, tokenizer, fmt, min(trl_steps(cfg), MAX_ROWS_STEPS) * t.prompts_per_step)
    args = GRPOConfig(**trl_args(cfg, Path(out_path).parent / "trl-out"))
    trainer = GRPOTrainer(model=model, reward_funcs=[TaskReward(task)], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[wall_clock(cfg.run.max_minutes * 60)])
    started, cpu0 = time.time(), time.process_time()
    trainer.train()
    ended = time.time()
    save_policy(trainer.model, tokenizer, model_dir)
    logs = [r for r in trainer.state.log_history if "reward" in r]
    done = trainer.state.global_step
    samples = done * t.prompts_per_step * t.group_size
    result = dict(steps=done, samples=samples, train_s=round(ended - started, 1),
                  samples_per_s=samples / (ended - started), process_cpu_s=time.process_time() - cpu0,
                  train_start=started, train_end=ended, threads=threads, start_checkpoint=spec.checkpoint,
                  final_checkpoint=str(model_dir), reward_mean=_mean([r["reward"] for r in logs]),
                  truncated_frac=_mean([r.get("completions/clipped_ratio") for r in logs]))
    Path(out_path).write_text(json.dumps(result))
    return 0


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trl_side", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("result")
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    return run(args.config, args.result, args.model_dir, args.threads)


if __name__ == "__main__":
    sys.exit(main())
