"""The live line says what its figures are: on how many problems the accuracy was measured, peer samples
received against those the objective read, and the share of samples cut at max_new_tokens; the final table
says that share too."""

from __future__ import annotations

from pathlib import Path

from engine.config import load_run_config
from engine.prep.prepare import PrepResult
from engine.record.display import LiveDisplay, print_summary
from engine.runtime.plane import LearnerFinal, StepReport

ROOT = Path(__file__).resolve().parents[1]


def _preps(cfg, cut: float | None = None) -> list[PrepResult]:
    return [PrepResult(model=m, checkpoint="", warm_accuracy=0.2, warm_accuracy_stderr=0.01, eval_n=2000,
                       vocab_size=100, warm_truncated=cut) for m in cfg.names]


def test_the_live_line_names_its_sample_sizes_and_received_vs_used():
    cfg = load_run_config(ROOT / "configs/default.toml")
    display = LiveDisplay(cfg, _preps(cfg), enabled=False)
    assert f"acc@{cfg.eval.num_problems} 0.200" in display.line("gpt2")  # the warm start's, on the full set
    assert "  cut    -  " in display.line("gpt2")  # no step yet
    display.update("gpt2", 7, StepReport(0.5, 1.0, 0.1, 448, 430, None, 12, 0.125))
    line = display.line("gpt2")
    assert "step    7/" in line and "peer recv 430 used 12" in line and f"acc@{cfg.eval.num_problems}" in line
    assert "cut  12%" in line
    display.update("gpt2", 100, StepReport(0.6, 1.0, 0.1, 6400, 6300, 0.26, 900, 0.0))
    line = display.line("gpt2")
    assert f"acc@{cfg.eval.live_problems} 0.260" in line  # live eval: fewer problems, said so
    assert "cut   6%" in line  # over the steps it saw (up to the last 10): the mean of 12.5% and 0%
    legend = LiveDisplay.legend(cfg)
    assert f"eval.live_problems={cfg.eval.live_problems}" in legend and "peer exp. used" in legend
    assert f"cut: share of its own samples of the last 10 steps that hit train.max_new_tokens=" \
           f"{cfg.train.max_new_tokens} without EOS" in legend


def test_the_final_table_shows_the_cut_before_and_after_and_in_training(capsys):
    cfg = load_run_config(ROOT / "configs/default.toml", ["eval.max_new_tokens=32"])
    finals = {"gpt2": LearnerFinal("gpt2", 400, [], "c", 0.217, 0.009, 2000, 25600, 25000, 900, False, 0.313)}
    print_summary(cfg, _preps(cfg, 0.0), finals, {"gpt2": 0.28, "llama": 0.003})
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.split()[1:2] in (["gpt2"], ["llama"])}
    assert "cut (eval)" in out and "cut (train)" in out
    assert "0% → 31%" in rows["gpt2"] and "28%" in rows["gpt2"]
    assert "0% → -" in rows["llama"] and "<1%" in rows["llama"]  # no final; a few cut is not "0%"
    assert "cut: no EOS by max_new_tokens (eval before → after RL: eval.max_new_tokens=32; train, last 10 steps: " \
           f"train.max_new_tokens={cfg.train.max_new_tokens})" in out
    print_summary(cfg, _preps(cfg), finals)  # an eval cache from before the count; no training window
    assert "- → 31%" in capsys.readouterr().out


def test_acc_at_n_counts_the_problems_there_were_not_the_number_configured():
    """A task with two held-out problems, eval.num_problems = 1000 and eval.live_problems = 500 (issue 58): the
    warm start's and the live accuracies were measured on 2 problems, and the line says acc@2, not acc@1000."""
    cfg = load_run_config(ROOT / "configs/default.toml", ["eval.num_problems=1000", "eval.live_problems=500"])
    preps = [PrepResult(model=m, checkpoint="", warm_accuracy=0.5, warm_accuracy_stderr=0.35, eval_n=2,
                        vocab_size=100) for m in cfg.names]
    display = LiveDisplay(cfg, preps, enabled=False)
    assert "acc@2 0.500" in display.line("gpt2") and "acc@1000" not in display.line("gpt2")
    display.update("gpt2", 50, StepReport(0.6, 1.0, 0.1, 3200, 0, 1.0, 0, 0.0, 0.0, 2))
    assert "acc@2 1.000" in display.line("gpt2")
    display.update("gpt2", 51, StepReport(0.6, 1.0, 0.1, 3264, 0, None, 0, 0.0))  # no evaluation this step
    assert "acc@2 1.000" in display.line("gpt2")
