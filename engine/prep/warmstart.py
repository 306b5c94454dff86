"""Warm start: a short supervised pass on the task's worked solutions, cached on disk.

RL on a randomly initialised model has no reward signal, so each model first imitates
worked solutions for a bounded number of steps (or seconds), stopping early once it is
good enough that RL has signal but far enough from perfect that RL has room. The result
is cached under a key hashing everything that determines it, so it runs once per machine.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path
import msgspec
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.config.schema import WarmStartConfig
from engine.prep.evaluation import evaluate
from engine.train.optim import adamw
from policies.backend import HFBackend
from policies.logprobs import token_logprobs
from policies.models import ModelLoadError, ModelSpec, build_policy, load_policy, pad_token_id, save_policy
from policies.templates import completion_ids, end_ids, prompt_format, prompt_ids
from tasks.base import Task, task_identity

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the recipe changes, so old cached models are not reused
WARM_START_FIRST_ID = 10**9  # prompt ids used here; RL's scheduler counts from 0
MAX_NEW_TOKENS = 32  # for the early-stopping accuracy check
PROGRESS_EVERY_S = 15.0  # without a terminal, a progress line this often


class WarmStartReport(msgspec.Struct):
    """Saved next to the cached model as warmstart.json."""

    steps: int
    seconds: float
    final_loss: float
    train_accuracy: float | None  # the last early-stopping check, if any ran


def cache_key(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, task: Task, config: WarmStartConfig) -> str:
    """Hash of everything that determines the warm-started weights (not the model's name)."""
    identity = {
        "format": CACHE_FORMAT,
        "spec": _spec_identity(spec),
        "vocab_size": len(tokenizer),
        "task": task_identity(task),
        "warm_start": config,
    }
    return hashlib.sha256(msgspec.json.encode(identity)).hexdigest()


def _spec_identity(spec: ModelSpec) -> dict:
    """The spec without its name, and without a prompt format left at its default: the keys of the warm starts
    cached before a model could have its own prompt stay what they were."""
    fields = msgspec.structs.asdict(msgspec.structs.replace(spec, name=""))
    if not fields["prompt"] and fields["end"] == "eos":
        del fields["prompt"], fields["end"]
    return fields


def warm_start_path(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, task: Task, config: WarmStartConfig, cache_dir: str | Path
) -> Path:
    """The checkpoint directory warm_start reads or writes for these inputs."""
    return Path(cache_dir) / f"warmstart-{spec.arch}-{cache_key(spec, tokenizer, task, config)[:20]}"


def warm_start(*args, **kwargs) -> PreTrainedModel:
    """``warm_start_and_end``'s policy alone: loaded from `cache_dir` if trained before, else trained there and
    cached (at `warm_start_path(...)`, a save_pretrained dir with a warmstart.json report)."""
    return warm_start_and_end(*args, **kwargs)[0]


def warm_start_and_end(
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    config: WarmStartConfig,
    cache_dir: str | Path,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, str]:
    """``warm_start``'s policy, and how its warm start ended (``why_it_stopped``), "loaded from cache (...)" when
    it was: the user learns whether the model reached stop_accuracy or only ran out of steps."""
    path = warm_start_path(spec, tokenizer, task, config, cache_dir)
    if path.is_dir():
        try:
            ended = NO_WARM_START if config.steps == 0 else f"loaded from cache ({_cached_end(path, config)})"
            return load_policy(path).to(device), ended
        except ModelLoadError as exc:
            log.warning("retraining: cached warm start is unusable: %s", exc)
    model = build_policy(spec, tokenizer, seed=config.seed).to(device)
    report = train_on_solutions(model, spec, tokenizer, task, config, progress)
    save_policy(model, tokenizer, path, extra_files={"warmstart.json": msgspec.json.encode(report)})
    return model.eval(), why_it_stopped(report, config)


NO_WARM_START = "none (warmstart_steps = 0): the model starts as its checkpoint is"  # cached or not


def why_it_stopped(report: WarmStartReport, config: WarmStartConfig) -> str:
    """One phrase: reached stop_accuracy at step N, or ran to its step cap (or time limit) with accuracy Y.

    Derived from the report and the config (the cache key holds the config), so reports cached before this
    phrase existed say it too."""
    acc, goal = report.train_accuracy, config.stop_accuracy
    if config.steps == 0:
        return NO_WARM_START
    if goal is not None and acc is not None and acc >= goal:
        return f"reached stop_accuracy {goal:g} at step {report.steps} with train accuracy {acc:.2f}"
    end = (f"ran to its step cap {config.steps}" if report.steps >= config.steps
           else f"ran out of its time limit warmstart.seconds={config.seconds:g} at step {report.steps}")
    if goal is None:
        return f"{end} (no stop_accuracy set)"
    if acc is None:
        return f"{end} before its first accuracy check (check_every={config.check_every} steps)"
    return f"{end} with train accuracy {acc:.2f} at its last check, short of stop_accuracy {goal:g}"


def _cached_end(path: Path, config: WarmStartConfig) -> str:
    try:
        report = msgspec.json.decode((path / "warmstart.json").read_bytes(), type=WarmStartReport)
    except (OSError, msgspec.DecodeError):
        return "its warmstart.json is missing or unreadable"
    return f"it {why_it_stopped(report, config)}"


def train_on_solutions(
    model: PreTrainedModel,
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    config: WarmStartConfig,
    progress: bool = True,
) -> WarmStartReport:
    """Supervised steps on worked solutions (NLL of the completion tokens, EOS included)."""
    optimizer = adamw(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    ramp = lambda step: min(1.0, (step + 1) / max(1, config.warmup_steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ramp)
    started, loss_value, accuracy, step = time.monotonic(), float("nan"), None, 0
    with _progress_bar(spec.name, config.steps, progress) as (bar, bar_task):
        while step < config.steps and not _out_of_time(started, config.seconds):
            batch = _batch(spec, tokenizer, task, WARM_START_FIRST_ID + step * config.batch_size, config.batch_size)
            model.train()
            lp = token_logprobs(model, *(t.to(model.device) for t in batch))
            loss = -lp.sum() / batch[2].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step, loss_value = step + 1, loss.item()
            bar.update(bar_task, advance=1, loss=loss_value)
            if config.stop_accuracy is not None and step % config.check_every == 0:
                accuracy = _train_accuracy(model, spec, tokenizer, task, config)
                bar.update(bar_task, accuracy=f"{accuracy:.2f}")
                if accuracy >= config.stop_accuracy:
                    break
    model.eval()
    return WarmStartReport(steps=step, seconds=time.monotonic() - started, final_loss=loss_value, train_accuracy=accuracy)


def _batch(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, task: Task, first_id: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, target_mask), each (B, L); targets = completion."""
    rows = []
    for prompt_id in range(first_id, first_id + size):
        problem = task.problem(prompt_id)
        prompt = prompt_ids(tokenizer, prompt_format(spec), problem.prompt)
        completion = completion_ids(tokenizer, task.worked_solution(problem), spec.end)
        if len(prompt) + len(completion) > spec.max_seq_len:
            raise ValueError(
                f"a {task.name} problem needs {len(prompt) + len(completion)} tokens with model "
                f"{spec.name!r}, more than its max_seq_len={spec.max_seq_len}; raise max_seq_len"
            )
        rows.append((prompt, completion))
    L = max(len(p) + len(c) for p, c in rows)
    pad = pad_token_id(tokenizer)
    ids = torch.full((size, L), pad, dtype=torch.long)
    attention = torch.zeros((size, L), dtype=torch.long)
    targets = torch.zeros((size, L), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        targets[i, len(prompt) : n] = True
    return ids, attention, targets


def _train_accuracy(
    model: PreTrainedModel, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, task: Task, config: WarmStartConfig
) -> float:
    """Greedy accuracy on training problems (the held-out set stays unseen)."""
    backend = HFBackend(model, tokenizer.eos_token_id, pad_token_id(tokenizer), device=model.device,
                        stop_ids=end_ids(tokenizer, spec.end))
    result = evaluate(
        backend, tokenizer, prompt_format(spec), task, config.check_problems, max_new_tokens=MAX_NEW_TOKENS, split="train"
    )
    return result.accuracy


def _out_of_time(started: float, seconds: float | None) -> bool:
    return seconds is not None and time.monotonic() - started >= seconds


class _ProgressLines:
    """Without a terminal (a log file, a CI job): one plain line on stderr every ``every_s`` seconds."""

    def __init__(self, name: str, total: int, every_s: float | None = None) -> None:
        every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.name, self.total, self.every_s = name, total, every_s
        self.done, self.loss, self.accuracy = 0, float("nan"), "-"
        self.started = self.last = time.monotonic()

    def update(self, _task: int, advance: int = 0, loss: float | None = None, accuracy: str | None = None) -> None:
        self.done += advance
        self.loss = self.loss if loss is None else loss
        self.accuracy = self.accuracy if accuracy is None else accuracy
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            elapsed = now - self.started
            left = elapsed / max(self.done, 1) * (self.total - self.done)
            print(f"warm start {self.name}: step {self.done}/{self.total}, loss {self.loss:.3f}, train acc "
                  f"{self.accuracy}, {elapsed:.0f}s elapsed, at most {left:.0f}s left", file=sys.stderr, flush=True)


class _progress_bar:
    """A rich progress bar on stderr; plain lines every few seconds when progress=False (no terminal)."""

    def __init__(self, name: str, total: int, enabled: bool) -> None:
        self.lines = None if enabled else _ProgressLines(name, total)
        columns = [
            TextColumn(f"warm start {name}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f} acc {task.fields[accuracy]}"),
            TimeElapsedColumn(),
        ]
        self.progress = Progress(*columns, console=Console(stderr=True), disable=not enabled)
        self.total = total

    def __enter__(self) -> tuple[Progress | _ProgressLines, int]:
        if self.lines is not None:
            return self.lines, 0
        self.progress.__enter__()
        return self.progress, self.progress.add_task("warm", total=self.total, loss=float("nan"), accuracy="-")

    def __exit__(self, *exc: object) -> None:
        if self.lines is None:
            self.progress.__exit__(*exc)
