"""Warm start and evaluation: learning on worked solutions, the on-disk cache, held-out accuracy."""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import pytest
import torch

from engine.prep.evaluation import EvalResult, evaluate
from engine.config.schema import WarmStartConfig
from engine.prep.warmstart import (WarmStartReport, _batch, warm_start, warm_start_and_end, warm_start_path,
                                  why_it_stopped)
from policies.backend import HFBackend
from policies.logprobs import token_logprobs
from policies.models import build_policy
from tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from tasks.countdown import CountdownConfig, CountdownTask
from test_models_fixtures import pad_id, real_tokenizer, tiny_spec

QUICK = WarmStartConfig(steps=15, batch_size=16, lr=3e-3, warmup_steps=2, seed=1)


def _solution_nll(model, spec, tokenizer, task) -> float:
    batch = _batch(spec, tokenizer, task, first_id=0, size=32)
    with torch.no_grad():
        return (-token_logprobs(model, *batch).sum() / batch[2].sum()).item()


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_warm_start_learns_and_is_cached_once(arch: str, tmp_path: Path) -> None:
    spec = tiny_spec(arch)
    tokenizer = real_tokenizer(spec.tokenizer)
    task = CountdownTask(CountdownConfig())
    before = _solution_nll(build_policy(spec, tokenizer, seed=QUICK.seed), spec, tokenizer, task)
    model = warm_start(spec, tokenizer, task, QUICK, tmp_path, progress=False)
    assert _solution_nll(model, spec, tokenizer, task) < before - 1.0
    (entry,) = _entries(tmp_path)  # one finished directory, no temporary leftovers
    assert warm_start_path(spec, tokenizer, task, QUICK, tmp_path) == tmp_path / entry
    report = msgspec.json.decode((tmp_path / entry / "warmstart.json").read_bytes(), type=WarmStartReport)
    assert report.steps == QUICK.steps and math.isfinite(report.final_loss)
    stamp = (tmp_path / entry / "model.safetensors").stat().st_mtime_ns
    again = warm_start(spec, tokenizer, task, QUICK, tmp_path, progress=False)
    assert (tmp_path / entry / "model.safetensors").stat().st_mtime_ns == stamp, "cache hit must not retrain"
    for name, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name


def test_cache_key_covers_spec_task_and_config_but_not_the_name(tmp_path: Path) -> None:
    spec = tiny_spec("gpt2")
    tokenizer = real_tokenizer("gpt2")
    short = msgspec.structs.replace(QUICK, steps=2)
    task = ArithmeticTask(ArithmeticConfig())
    warm_start(spec, tokenizer, task, short, tmp_path, progress=False)
    warm_start(msgspec.structs.replace(spec, name="renamed"), tokenizer, task, short, tmp_path, progress=False)
    assert len(_entries(tmp_path)) == 1
    warm_start(spec, tokenizer, task, msgspec.structs.replace(short, seed=2), tmp_path, progress=False)
    warm_start(spec, tokenizer, ArithmeticTask(ArithmeticConfig(max_digits=3)), short, tmp_path, progress=False)
    warm_start(msgspec.structs.replace(spec, n_layer=1), tokenizer, task, short, tmp_path, progress=False)
    assert len(_entries(tmp_path)) == 4


def test_corrupt_cache_entry_is_retrained_and_replaced(tmp_path: Path) -> None:
    spec, tokenizer, task = tiny_spec("gpt2"), real_tokenizer("gpt2"), ArithmeticTask(ArithmeticConfig())
    config = msgspec.structs.replace(QUICK, steps=2)
    first = warm_start(spec, tokenizer, task, config, tmp_path, progress=False)
    (entry,) = _entries(tmp_path)
    weights = tmp_path / entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    second = warm_start(spec, tokenizer, task, config, tmp_path, progress=False)
    assert _entries(tmp_path) == [entry]
    assert torch.equal(first.lm_head.weight, second.lm_head.weight), "same seed, same steps: same weights"


def test_time_budget_stops_training(tmp_path: Path) -> None:
    spec, tokenizer, task = tiny_spec("llama"), real_tokenizer("mistral"), ArithmeticTask(ArithmeticConfig())
    config = WarmStartConfig(steps=10**6, seconds=0.5, batch_size=4)
    warm_start(spec, tokenizer, task, config, tmp_path, progress=False)
    (entry,) = _entries(tmp_path)
    report = msgspec.json.decode((tmp_path / entry / "warmstart.json").read_bytes(), type=WarmStartReport)
    assert 1 <= report.steps < 10**6 and report.seconds < 30


def test_the_warm_start_says_where_and_why_it_stopped(tmp_path: Path) -> None:
    """stop_accuracy is a goal the cap may cut short: the launcher says which end each model met."""
    spec, tokenizer, task = tiny_spec("gpt2"), real_tokenizer("gpt2"), ArithmeticTask(ArithmeticConfig())
    unreachable = msgspec.structs.replace(QUICK, steps=2, stop_accuracy=0.99, check_every=1, check_problems=4)
    _, ended = warm_start_and_end(spec, tokenizer, task, unreachable, tmp_path, progress=False)
    assert ended == "ran to its step cap 2 with train accuracy 0.00 at its last check, short of stop_accuracy 0.99"
    _, again = warm_start_and_end(spec, tokenizer, task, unreachable, tmp_path, progress=False)
    assert again == f"loaded from cache (it {ended})"
    none = msgspec.structs.replace(unreachable, steps=0)  # a checkpoint used as it is, the first time and after
    for _ in range(2):
        assert warm_start_and_end(spec, tokenizer, task, none, tmp_path, progress=False)[1] == \
            "none (warmstart_steps = 0): the model starts as its checkpoint is"
    report = lambda steps, acc: WarmStartReport(steps, seconds=1.0, final_loss=0.5, train_accuracy=acc)  # noqa: E731
    goal = WarmStartConfig(steps=600, stop_accuracy=0.55, check_every=50)
    assert why_it_stopped(report(350, 0.56), goal) == "reached stop_accuracy 0.55 at step 350 with train accuracy 0.56"
    assert why_it_stopped(report(600, 0.55), goal).startswith("reached stop_accuracy 0.55 at step 600")  # at the cap
    assert why_it_stopped(report(30, None), msgspec.structs.replace(goal, steps=30)) == \
        "ran to its step cap 30 before its first accuracy check (check_every=50 steps)"
    assert why_it_stopped(report(0, None), msgspec.structs.replace(goal, steps=0)) == \
        "none (warmstart_steps = 0): the model starts as its checkpoint is"
    timed = WarmStartConfig(steps=10**6, seconds=0.5)
    assert why_it_stopped(report(7, None), timed) == "ran out of its time limit warmstart.seconds=0.5 at step 7 " \
                                                     "(no stop_accuracy set)"


def test_too_long_problems_are_a_clear_error(tmp_path: Path) -> None:
    spec = tiny_spec("gpt2", max_seq_len=8)
    with pytest.raises(ValueError, match="more than its max_seq_len=8"):
        warm_start(spec, real_tokenizer("gpt2"), CountdownTask(CountdownConfig()), QUICK, tmp_path, progress=False)
    assert _entries(tmp_path) == []


def test_evaluate_counts_verified_greedy_answers() -> None:
    spec = tiny_spec("gpt2")
    tokenizer = real_tokenizer("gpt2")
    backend = HFBackend(build_policy(spec, tokenizer), tokenizer.eos_token_id, pad_id(tokenizer))
    task = ArithmeticTask(ArithmeticConfig())
    result = evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=16, max_new_tokens=4)
    assert result == evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=7, max_new_tokens=4)
    assert result.n == 40 and result.accuracy == 0.0 and result.stderr == 0.0  # untrained: gibberish

    class AnswerEverything(ArithmeticTask):  # a real task whose verifier accepts any text
        def verify(self, problem, completion_text):
            return super().verify(problem, problem.answer if problem.prompt_id % 4 == 0 else "x")

    half = evaluate(backend, tokenizer, "gpt2", AnswerEverything(ArithmeticConfig()), 40, max_new_tokens=2)
    assert half == EvalResult(accuracy=0.25, stderr=math.sqrt(0.25 * 0.75 / 40), n=40, truncated=1.0)  # gibberish


def _stops_at_once(model, eos: int):
    """The tiny GPT-2 made to answer EOS first, whatever the prompt: its last layer norm outputs one constant
    direction, which only EOS's output embedding reads (a model that finishes well inside any length)."""
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        out = model.get_output_embeddings().weight
        out[:, 0] = 0.0
        out[eos, 0] = 1.0
    return model


def test_evaluate_counts_completions_cut_at_max_new_tokens() -> None:
    """A completion that hits max_new_tokens without EOS is counted, whatever its verdict; one that ends with EOS,
    even on the last token allowed, is not."""
    spec, tokenizer, task = tiny_spec("gpt2"), real_tokenizer("gpt2"), ArithmeticTask(ArithmeticConfig())
    babbler = HFBackend(build_policy(spec, tokenizer), tokenizer.eos_token_id, pad_id(tokenizer))
    cut = evaluate(babbler, tokenizer, "gpt2", task, num_problems=20, batch_size=8, max_new_tokens=1)
    assert cut.truncated == 1.0 and cut.n == 20  # every completion cut after its one token
    stopper = _stops_at_once(build_policy(spec, tokenizer), tokenizer.eos_token_id)
    backend = HFBackend(stopper, tokenizer.eos_token_id, pad_id(tokenizer))
    for max_new_tokens in (16, 1):
        done = evaluate(backend, tokenizer, "gpt2", task, num_problems=20, batch_size=8, max_new_tokens=max_new_tokens)
        assert done.truncated == 0.0, max_new_tokens


@pytest.mark.slow
def test_stop_accuracy_leaves_room_for_rl(tmp_path: Path) -> None:
    spec, tokenizer = tiny_spec("gpt2"), real_tokenizer("gpt2")
    task = ArithmeticTask(ArithmeticConfig(min_digits=1, max_digits=1))
    config = WarmStartConfig(steps=2000, batch_size=32, lr=1e-2, stop_accuracy=0.15, check_every=25, seed=0)
    model = warm_start(spec, tokenizer, task, config, tmp_path, progress=False)
    (entry,) = _entries(tmp_path)
    report = msgspec.json.decode((tmp_path / entry / "warmstart.json").read_bytes(), type=WarmStartReport)
    assert report.steps < 2000 and report.train_accuracy >= 0.15
    backend = HFBackend(model, tokenizer.eos_token_id, pad_id(tokenizer))
    train = evaluate(backend, tokenizer, "gpt2", task, 200, split="train", max_new_tokens=4)
    assert 0.05 < train.accuracy < 0.9


def test_without_a_terminal_progress_is_plain_lines(tmp_path: Path, capfd, monkeypatch) -> None:
    """A warm start in a log file says how far it is (step / total, loss, time left), not one line then silence."""
    import engine.prep.warmstart as ws

    monkeypatch.setattr(ws, "PROGRESS_EVERY_S", 0.0)
    spec, tokenizer, task = tiny_spec("gpt2"), real_tokenizer("gpt2"), ArithmeticTask(ArithmeticConfig())
    warm_start(spec, tokenizer, task, QUICK, tmp_path, progress=False)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warm start ")]
    assert len(lines) == QUICK.steps
    assert lines[-1].startswith(f"warm start {spec.name}: step {QUICK.steps}/{QUICK.steps}, loss ")
    assert "elapsed, at most 0s left" in lines[-1]


def test_evaluation_says_where_it_is(capsys) -> None:
    from engine.prep.evaluation import EvalProgress

    spec = tiny_spec("gpt2")
    tokenizer = real_tokenizer("gpt2")
    backend = HFBackend(build_policy(spec, tokenizer), tokenizer.eos_token_id, pad_id(tokenizer))
    task = ArithmeticTask(ArithmeticConfig())
    seen = []
    evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=16, max_new_tokens=2,
             progress=lambda *p: seen.append(p))
    assert seen == [(16, 40, 0), (32, 40, 0), (40, 40, 0)]
    evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=16, max_new_tokens=2,
             progress=EvalProgress("gpt2 final (held-out)", every_s=0))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [line for line in lines if line.startswith("eval gpt2 final (held-out): ")] and len(lines) == 3
    assert "16/40 problems, accuracy so far 0.000" in lines[0] and "left" in lines[0]
    assert re.fullmatch(r"eval gpt2 final \(held-out\): 40/40 problems, accuracy 0\.000, \d+s", lines[2]), lines
    evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=16, max_new_tokens=2,
             progress=EvalProgress("gpt2 final (held-out)", every_s=3600))  # shorter than its progress lines
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("eval gpt2 final (held-out): 40/40 problems, accuracy 0.000, "), line
    evaluate(backend, tokenizer, "gpt2", task, num_problems=40, batch_size=16, max_new_tokens=2,
             progress=EvalProgress("gpt2 live at step 4", every_s=3600, result_line=False))  # the display says it
    assert capsys.readouterr().err == ""
