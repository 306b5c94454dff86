"""The live line says what its figures are: on how many problems the accuracy was measured, and peer
samples received against those the objective read."""

from __future__ import annotations

from pathlib import Path

from engine.config import load_run_config
from engine.prep.prepare import PrepResult
from engine.runtime.display import LiveDisplay
from engine.runtime.plane import StepReport

ROOT = Path(__file__).resolve().parents[1]


def test_the_live_line_names_its_sample_sizes_and_received_vs_used():
    cfg = load_run_config(ROOT / "configs/default.toml")
    preps = [PrepResult(model=m, checkpoint="", warm_accuracy=0.2, warm_accuracy_stderr=0.01, eval_n=2000, vocab_size=100)
             for m in cfg.names]
    display = LiveDisplay(cfg, preps, enabled=False)
    assert f"acc@{cfg.eval.num_problems} 0.200" in display.line("gpt2")  # the warm start's, on the full set
    display.update("gpt2", 7, StepReport(0.5, 1.0, 0.1, 448, 430, None, 12))
    line = display.line("gpt2")
    assert "step    7/" in line and "peer recv 430 used 12" in line and f"acc@{cfg.eval.num_problems}" in line
    display.update("gpt2", 100, StepReport(0.6, 1.0, 0.1, 6400, 6300, 0.26, 900))
    assert f"acc@{cfg.eval.live_problems} 0.260" in display.line("gpt2")  # live eval: fewer problems, said so
    legend = LiveDisplay.legend(cfg)
    assert f"eval.live_problems={cfg.eval.live_problems}" in legend and "peer exp. used" in legend
