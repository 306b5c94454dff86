"""`launch.py report`: report.md and its plots from run directories; bad input is one sentence and exit 2.

The run directories here are written with the engine's own MetricsWriter and config writer,
record by record as a learner writes them; a whole real run's report is checked by
tests/test_resume.py (every `launch.py run` and `resume` ends with one).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import load_run_config
from exchange.records import MetricsWriter
from engine.record.rundir import write_resolved_config
from monitor.report import ReportError, write_report
from tests.enginerun import ROOT


def _fake_run(path, objective: str, lift: float, steps: int = 12, cut: bool = True) -> None:
    """``cut``: the records say how many completions max_new_tokens cut (gpt2 more and more as it trains; a run
    from before they did: not)."""
    path.mkdir(parents=True)
    cfg = load_run_config(str(ROOT / "configs/smoke.toml"), [f"objective.kind={objective}"])
    write_resolved_config(cfg, path)
    e = MetricsWriter(path, "engine")
    for model, warm in (("gpt2", 0.2), ("llama", 0.5)):
        e.write(event="warm_start", model=model, accuracy=warm, **({"truncated": 0.0} if cut else {}))
        w = MetricsWriter(path, model)
        w.write(event="start", step=0, warm_accuracy=warm, warm_accuracy_stderr=0.02)
        for k in range(1, steps + 1):
            peer = "llama" if model == "gpt2" else "gpt2"
            w.write(event="step", step=k, prompts=list(range(8 * (k - 1), 8 * k)), reward_mean=warm + lift * k / steps,
                    staleness_mean=1.0, own_experiences=64 * k, peer_used=3 * k, thl_residual_mean=0.5,
                    thl_residual_by_peer={peer: 0.5}, **({"obj/rescue_set_size": 2.0} if objective == "sgt" else {}),
                    **({"accuracy": warm + lift / 2} if k == 6 else {}),
                    **({"truncated_frac": k / 40 if model == "gpt2" else 0.0} if cut else {}))
        w.write(event="final", step=steps, accuracy=warm + lift, accuracy_stderr=0.02, own_experiences=64 * steps,
                peer_used=3 * steps, wall_s=20.0, **({"truncated": 0.25 if model == "gpt2" else 0.0} if cut else {}))
        w.close()
    if cut:
        e.write(event="truncation", model="gpt2", kind="train", frac=0.2125, key="train.max_new_tokens",
                max_new_tokens=6)
    e.write(event="allocation", t=0.0, counts={"generator:gpt2": 1, "learner:gpt2": 1})
    e.close()


def test_a_report_of_one_run_and_of_two_overlaid(tmp_path):
    _fake_run(tmp_path / "solo", "grpo", 0.01, cut=False)
    _fake_run(tmp_path / "mutual", "sgt", 0.05)
    one = write_report([tmp_path / "mutual"])
    text = one.read_text()
    # cut: none before RL, a quarter after; in training the mean of its last 10 steps' (3/40 .. 12/40)
    assert "| mutual | gpt2 | 20.0% ± 2.0 | 25.0% ± 2.0 | +5.0 pts | 0% → 25% | 19% | 12 | 768 | 36 |" in text
    assert "| mutual | llama | 50.0% ± 2.0 | 55.0% ± 2.0 | +5.0 pts | 0% → 0% | 0% | 12 |" in text
    assert "*Cut*: the share of completions that hit `max_new_tokens` without EOS" in text
    assert "truncation (gpt2): kind=train, frac=0.2125, key=train.max_new_tokens, max_new_tokens=6" in text
    for name in ("accuracy.png", "reward.png", "staleness.png", "thl_residual.png", "rescue.png"):
        assert (tmp_path / "mutual" / name).stat().st_size > 5000 and f"]({name})" in text
    assert "## THL residual" in text and "## Rescue set (SGT)" in text and "## Reward" in text
    both = write_report([tmp_path / "solo", tmp_path / "mutual"], tmp_path / "compare")
    text = both.read_text()
    assert "`solo` (grpo)" in text and "`mutual` (sgt)" in text
    assert "| solo | llama | 50.0% ± 2.0 | 51.0% ± 2.0 | +1.0 pts | - → - | - |" in text  # run before the count
    assert "rescue.png" in text  # one run has a rescue set: the plot is there, with that run's line


def test_bad_input_is_one_sentence_and_exit_2(tmp_path):
    _fake_run(tmp_path / "torn", "grpo", 0.01)
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as f:
        f.write('{"time": 1, "model": "gpt2", "ev')  # killed mid-write
    assert "1 unreadable lines of metrics.jsonl skipped" in write_report([tmp_path / "torn"]).read_text()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    cases = [([str(tmp_path / "missing")], "no such run directory"),
             ([str(tmp_path)], "not a run directory (no metrics.jsonl)"),
             ([str(tmp_path / "empty")], "holds no learner step yet"),
             ([str(tmp_path / "torn"), str(tmp_path / "torn")], "--out DIR")]
    for args, words in cases:
        with pytest.raises(ReportError, match=words.replace("(", r"\(").replace(")", r"\)")):
            write_report(args[:1] if len(args) == 1 else args)
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "report", str(tmp_path / "missing")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().endswith("no such run directory")
    assert "Traceback" not in out.stderr
