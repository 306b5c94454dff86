"""Held-out accuracy of a policy: generate on the task's eval set, verify, count."""

from __future__ import annotations

import math
from typing import Literal

import msgspec
from transformers import PreTrainedTokenizerBase

from policies.backend import GenerationBackend
from policies.templates import prompt_ids
from tasks.base import Task


class EvalResult(msgspec.Struct, frozen=True):
    """Accuracy over n held-out problems, one sample each."""

    accuracy: float  # fraction verified correct
    stderr: float  # binomial standard error, sqrt(p (1 - p) / n)
    n: int


def evaluate(
    backend: GenerationBackend,
    tokenizer: PreTrainedTokenizerBase,
    arch: str,
    task: Task,
    num_problems: int,
    temperature: float = 0.0,
    batch_size: int = 128,
    max_new_tokens: int = 24,
    seed: int = 0,
    split: Literal["eval", "train"] = "eval",
) -> EvalResult:
    """Accuracy on problems 0..num_problems-1 of the held-out set (greedy by default,
    so reproducible). split="train" measures training problems instead (for early
    stopping without peeking at the held-out set)."""
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    draw = task.eval_problem if split == "eval" else task.problem
    correct = 0
    for start in range(0, num_problems, batch_size):
        problems = [draw(i) for i in range(start, min(start + batch_size, num_problems))]
        prompts = [prompt_ids(tokenizer, arch, p.question) for p in problems]
        samples = backend.generate(prompts, 1, max_new_tokens, temperature, seed=seed + start)
        for problem, (sample,) in zip(problems, samples):
            text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
            correct += task.verify(problem, text).verified
    accuracy = correct / num_problems
    return EvalResult(accuracy=accuracy, stderr=math.sqrt(accuracy * (1 - accuracy) / num_problems), n=num_problems)


def held_out_accuracy(model, tokenizer: PreTrainedTokenizerBase, arch: str, task: Task, num_problems: int,
                      settings, max_new_tokens: int) -> EvalResult:
    """``evaluate`` of a policy module as it is (eval mode for the duration), with a run's ``[eval]`` settings."""
    from policies.backend import HFBackend
    from policies.models import pad_token_id

    was_training = model.training
    device = next(model.parameters()).device
    try:
        backend = HFBackend(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer),
                            device=device)
        return evaluate(backend, tokenizer, arch, task, num_problems, temperature=settings.temperature,
                        batch_size=settings.batch_size, max_new_tokens=max_new_tokens)
    finally:
        model.train(was_training)
