"""Held-out accuracy of a policy: generate on the task's eval set, verify, count."""

from __future__ import annotations

import math
import sys
import time
import weakref
from typing import Literal

import msgspec
from transformers import PreTrainedTokenizerBase

from policies.backend import GenerationBackend
from policies.templates import PromptFormat, as_format, end_ids, prompt_ids
from tasks.base import Problem, Task
from tasks.rewards import score

EVAL_PROGRESS_EVERY_S = 5.0
# draws of eval_problem in a row that bring no new question before the held-out set is taken to be exhausted (a
# task that cycles, as a small JSONL file does, repeats itself from then on)
REPEATS_TO_EXHAUSTED = 100
_DISTINCT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # task -> its distinct held-out problems so far


class EvalResult(msgspec.Struct, frozen=True):
    """Accuracy over n held-out problems, one sample each."""

    accuracy: float  # fraction verified correct
    stderr: float  # binomial standard error, sqrt(p (1 - p) / n)
    n: int
    # fraction of completions that hit max_new_tokens without EOS: the verifier judged a cut answer (its last
    # number may be half an equation), so a high one says the length, not the model, decided the accuracy
    truncated: float = 0.0


def evaluate(
    backend: GenerationBackend,
    tokenizer: PreTrainedTokenizerBase,
    arch: str | PromptFormat,  # a family, or a model's prompt format (policies.templates.prompt_format)
    task: Task,
    num_problems: int,
    temperature: float = 0.0,
    batch_size: int = 128,
    max_new_tokens: int = 24,
    seed: int = 0,
    split: Literal["eval", "train"] = "eval",
    progress=None,
    reward_errors: Literal["stop", "zero"] = "stop",
) -> EvalResult:
    """Accuracy on problems 0..num_problems-1 of the held-out set (greedy by default,
    so reproducible). split="train" measures training problems instead (for early
    stopping without peeking at the held-out set). ``progress(done, total, correct)`` is called after
    each batch. Completions that end without EOS are counted (``truncated``), whatever their verdict. A verifier
    that raises is a VerifierError, or with ``reward_errors="zero"`` a wrong answer (train.reward_errors)."""
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    if split == "eval":  # each held-out question scored once: a repeated one would shrink the standard error
        held_out = held_out_problems(task, num_problems)
        num_problems, draw = len(held_out), held_out.__getitem__
    else:
        draw = task.problem
    correct = cut = 0
    errors: list[str] | None = [] if reward_errors == "zero" else None
    for start in range(0, num_problems, batch_size):
        problems = [draw(i) for i in range(start, min(start + batch_size, num_problems))]
        prompts = [prompt_ids(tokenizer, arch, p.prompt) for p in problems]
        samples = backend.generate(prompts, 1, max_new_tokens, temperature, seed=seed + start)
        texts = [tokenizer.decode(sample.completion_ids, skip_special_tokens=True) for (sample,) in samples]
        ids = [sample.completion_ids for (sample,) in samples]
        # successes only: a reward function the success rule does not read is not called (a broken one that
        # stopped the run is not called again by the final evaluation where the answer check decides)
        correct += sum(v.verified for v in score(task, problems, texts, errors, ids, only_success=True))
        cut += sum(sample.finish_reason == "length" for (sample,) in samples)
        if progress is not None:
            progress(start + len(problems), num_problems, correct)
    accuracy = correct / num_problems
    return EvalResult(accuracy=accuracy, stderr=math.sqrt(accuracy * (1 - accuracy) / num_problems), n=num_problems,
                      truncated=cut / num_problems)


def held_out_problems(task: Task, wanted: int) -> list[Problem]:
    """The task's first ``wanted`` distinct held-out questions, in order, or all there are when fewer exist: the
    draws stop where ``eval_problem`` raises IndexError or ValueError (no such problem) or brings nothing new
    REPEATS_TO_EXHAUSTED times in a row (it cycles). Remembered per task object."""
    try:
        found, questions, index, repeats = _DISTINCT[task]
    except (KeyError, TypeError):
        found, questions, index, repeats = [], set(), 0, 0
    while len(found) < wanted and repeats < REPEATS_TO_EXHAUSTED:
        try:
            problem = task.eval_problem(index)
        except (IndexError, ValueError):
            if index == 0:
                raise
            repeats = REPEATS_TO_EXHAUSTED  # exhausted: asking again would only raise again
            break
        index += 1
        repeats = repeats + 1 if problem.question in questions else 0
        if not repeats:
            questions.add(problem.question)
            found.append(problem)
    try:
        _DISTINCT[task] = (found, questions, index, repeats)
    except TypeError:  # a task that cannot be weakly referenced is drawn anew each time
        pass
    return found[:wanted]


class EvalProgress:
    """A line on stderr every ``every_s`` seconds while an evaluation runs (what is evaluated, problems done,
    accuracy so far, elapsed, time left), and with ``result_line`` one line with its result at its end: a short
    evaluation, which ends before its first progress line, says its result too."""

    def __init__(self, label: str, every_s: float = EVAL_PROGRESS_EVERY_S, result_line: bool = True) -> None:
        self.label, self.every_s, self.result_line = label, every_s, result_line
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int, correct: int) -> None:
        now = time.monotonic()
        elapsed = now - self.started
        if done >= total:
            if self.result_line:
                print(f"eval {self.label}: {total}/{total} problems, accuracy {correct / total:.3f}, {elapsed:.0f}s",
                      file=sys.stderr, flush=True)
        elif now - self.last >= self.every_s:
            self.last = now
            print(f"eval {self.label}: {done}/{total} problems, accuracy so far {correct / done:.3f}, "
                  f"{elapsed:.0f}s elapsed, about {elapsed / done * (total - done):.0f}s left",
                  file=sys.stderr, flush=True)


def held_out_accuracy(model, tokenizer: PreTrainedTokenizerBase, arch: str | PromptFormat, task: Task, num_problems: int,
                      settings, max_new_tokens: int, label: str | None = None,
                      result_line: bool = True, reward_errors: Literal["stop", "zero"] = "stop") -> EvalResult:
    """``evaluate`` of a policy module as it is (eval mode for the duration), with a run's ``[eval]`` settings;
    ``label`` (e.g. "gpt2 final (held-out)"): progress lines while it runs and, with ``result_line``, its result
    at its end."""
    from policies.backend import HFBackend
    from policies.models import pad_token_id

    was_training = model.training
    device = next(model.parameters()).device
    try:
        backend = HFBackend(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer),
                            device=device, stop_ids=end_ids(tokenizer, as_format(arch).end))
        return evaluate(backend, tokenizer, arch, task, num_problems, temperature=settings.temperature,
                        batch_size=settings.batch_size, max_new_tokens=max_new_tokens,
                        progress=EvalProgress(label, result_line=result_line) if label else None,
                        reward_errors=reward_errors)
    finally:
        model.train(was_training)
