"""Completions cut at max_new_tokens are never unseen: the one-line warning past a fifth (once per model and kind,
with a metrics.jsonl record), and the warm start's evaluation cache keyed on the length it decodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import load_run_config
from engine.prep.prepare import PrepResult, _cached_eval
from exchange.records import MetricsWriter
from engine.runtime.plane import LearnerFinal, StepReport
from engine.record.truncation import TRAIN_WINDOW_STEPS, CutWatch
from monitor.report import TRAIN_WINDOW_STEPS as REPORT_WINDOW
from policies.models import build_policy
from tasks.registry import make_task
from test_models_fixtures import real_tokenizer, tiny_spec

ROOT = Path(__file__).resolve().parents[1]


def _prep(model: str, cut: float | None) -> PrepResult:
    return PrepResult(model=model, checkpoint="", warm_accuracy=0.5, warm_accuracy_stderr=0.01, eval_n=18,
                      vocab_size=100, warm_truncated=cut)


def _step(cut: float, eval_cut: float | None = None) -> StepReport:
    return StepReport(0.5, 1.0, 0.1, 64, 0, None, 0, truncated_frac=cut, eval_truncated=eval_cut)


def _final(model: str, cut: float) -> LearnerFinal:
    return LearnerFinal(model, 12, [], "", 0.5, 0.1, 18, 768, 0, 0, False, cut)


def _records(run_dir: Path) -> list[dict]:
    return [r for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if (r := json.loads(line))["event"] == "truncation"]


def test_more_than_a_fifth_cut_is_one_line_and_one_record_per_model_and_kind(tmp_path, capsys):
    cfg = load_run_config(ROOT / "configs/smoke.toml")  # train.max_new_tokens = 6, eval at the same length
    watch = CutWatch(cfg, MetricsWriter(tmp_path, "engine"), None, [_prep("gpt2", 0.25), _prep("llama", 0.2)])
    (line,) = capsys.readouterr().err.splitlines()  # a fifth exactly is not "more than a fifth"
    assert line == ("warning: gpt2: 25% of its completions in the evaluation after the warm start hit "
                    "train.max_new_tokens=6 without EOS, so the accuracy judged cut answers; raise it "
                    "(e.g. --set train.max_new_tokens=12)")
    for k in range(1, TRAIN_WINDOW_STEPS):  # gpt2 cuts half its samples, llama 10%: judged once the window is full
        watch.stepped("gpt2", k, _step(0.5, eval_cut=0.9 if k == 5 else None))  # gpt2's eval kind was said already
        watch.stepped("llama", k, _step(0.1))
    assert capsys.readouterr().err == ""
    watch.stepped("gpt2", TRAIN_WINDOW_STEPS, _step(0.5))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: gpt2: 50% of its training samples over its last {TRAIN_WINDOW_STEPS} steps "
                           "hit train.max_new_tokens=6 without EOS, so RL learns")
    assert line.endswith("raise it (e.g. --set train.max_new_tokens=12)")
    for k in range(TRAIN_WINDOW_STEPS + 1, 2 * TRAIN_WINDOW_STEPS):
        watch.stepped("gpt2", k, _step(0.6))
        watch.stepped("llama", k, _step(0.0, eval_cut=0.3 if k == 15 else None))  # a live eval: llama's first
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: llama: 30% of its completions in the live evaluation at step 15 hit")
    assert watch.train_frac("gpt2") == pytest.approx(0.59) and watch.train_frac("llama") == pytest.approx(0.01)
    watch.finished(_final("gpt2", 0.9))
    watch.finished(_final("llama", 0.9))  # both kinds said for both models: nothing more
    assert capsys.readouterr().err == ""
    records = [(r["model"], r["kind"], r["frac"], r["key"], r["max_new_tokens"]) for r in _records(tmp_path)]
    assert records == [("gpt2", "eval", 0.25, "train.max_new_tokens", 6),
                       ("gpt2", "train", 0.5, "train.max_new_tokens", 6),
                       ("llama", "eval", 0.3, "train.max_new_tokens", 6)]


def test_a_short_run_and_a_final_evaluation_are_judged_at_the_end(tmp_path, capsys):
    """Fewer steps than the window: the training cut is judged on what was trained; eval.max_new_tokens, when
    set, is the length an evaluation's warning names."""
    cfg = load_run_config(ROOT / "configs/smoke.toml", ["eval.max_new_tokens=24"])
    watch = CutWatch(cfg, MetricsWriter(tmp_path, "engine"), None, [_prep("gpt2", None), _prep("llama", 0.0)])
    for k in (1, 2, 3):
        watch.stepped("gpt2", k, _step(0.3))
        watch.stepped("llama", k, _step(0.1))
    assert capsys.readouterr().err == ""
    watch.finished(_final("gpt2", 0.4))
    watch.finished(_final("llama", 0.05))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("warning: gpt2: 30% of its training samples over its last 3 steps hit "
                               "train.max_new_tokens=6 without EOS")
    assert lines[1].startswith("warning: gpt2: 40% of its completions in the final evaluation hit "
                               "eval.max_new_tokens=24 without EOS")
    assert lines[1].endswith("(e.g. --set eval.max_new_tokens=48)")
    assert [r["kind"] for r in _records(tmp_path)] == ["train", "eval"]


def test_the_report_spans_the_launchers_window():
    assert REPORT_WINDOW == TRAIN_WINDOW_STEPS  # monitor may not import the engine: the two must agree


def test_the_warm_start_eval_cache_keys_on_the_length_it_decodes_and_reads_old_files(tmp_path):
    """eval.max_new_tokens = 0 decodes the training length: the same key as before the setting existed, so a cache
    file written then (no "truncated") still answers, the cut then unknown; another length is another file."""
    cfg = load_run_config(ROOT / "configs/smoke.toml", ["eval.num_problems=4", "eval.batch_size=4"])
    spec, tokenizer, task = tiny_spec("gpt2"), real_tokenizer("gpt2"), make_task(cfg.task)
    model = build_policy(spec, tokenizer)
    fresh = _cached_eval(model, tokenizer, "gpt2", task, cfg, tmp_path, "gpt2")
    (path,) = tmp_path.glob("eval-*.json")
    assert fresh == json.loads(path.read_text()) and fresh["n"] == 4 and 0.0 <= fresh["truncated"] <= 1.0
    same = load_run_config(ROOT / "configs/smoke.toml", ["eval.num_problems=4", "eval.max_new_tokens=6"])
    path.write_text(json.dumps({"accuracy": 0.75, "stderr": 0.2, "n": 4}))  # as written before the cut was counted
    assert _cached_eval(None, tokenizer, "gpt2", task, same, tmp_path, "gpt2") == {"accuracy": 0.75, "stderr": 0.2,
                                                                                     "n": 4}  # no model needed
    shorter = load_run_config(ROOT / "configs/smoke.toml", ["eval.num_problems=4", "eval.max_new_tokens=1"])
    assert _cached_eval(model, tokenizer, "gpt2", task, shorter, tmp_path, "gpt2")["truncated"] == 1.0
    assert len(list(tmp_path.glob("eval-*.json"))) == 2
