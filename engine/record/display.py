"""What a person sees: one live line per model while the run goes, a summary table at the end.

On a terminal the lines redraw in place (rich); otherwise (CI, a log file) the same
lines are printed every ``plain_every_s`` seconds. The display sees every step report, so it
keeps the watch on completions cut at max_new_tokens (``engine.record.truncation``): its
``cut`` figure, and the warning when more than a fifth are cut.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from engine.record.truncation import TRAIN_WINDOW_STEPS, CutWatch, eval_length_key


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * min(done, total) / max(total, 1))
    return "█" * filled + "·" * (width - filled)


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class LiveDisplay:
    def __init__(self, cfg, preps, enabled: bool = True, plain_every_s: float = 10.0, say=None, metrics=None):
        """``say(text, err)`` and ``metrics`` (a MetricsWriter): where the cut warnings go (default: stderr only)."""
        self.cfg, self.names = cfg, cfg.names
        self.cut = CutWatch(cfg, metrics, say, preps)  # the warm starts' evaluations are judged here, once
        self.step = {n: 0 for n in self.names}
        self.report: dict[str, object] = {}
        self.acc: dict[str, float | None] = {p.model: p.warm_accuracy for p in preps}
        # distinct problems behind the shown accuracy: those evaluated (a task with fewer than eval.num_problems
        # held out has them all), not the number configured
        self.acc_n = {p.model: p.eval_n or cfg.eval.num_problems for p in preps}
        self.started = time.time()
        self.enabled, self.plain_every_s, self._last_plain = enabled, plain_every_s, time.time()
        self.live = None
        if enabled and sys.stdout.isatty():
            self.live = Live(self._render(), console=Console(), refresh_per_second=2)
            self.live.start()

    def update(self, model: str, step: int, report) -> None:
        self.step[model], self.report[model] = step, report
        self.cut.stepped(model, step, report)
        if report.accuracy is not None:
            self.acc[model], self.acc_n[model] = report.accuracy, report.eval_n or self.cfg.eval.live_problems

    def line(self, name: str) -> str:
        r, step, steps = self.report.get(name), self.step[name], self.cfg.train.steps
        rate = (r.own_total if r else 0) / max(time.time() - self.started, 1e-9)
        return (f"{name:>14} {_bar(step, steps)} step {step:>4}/{steps}  reward {_fmt(r and r.reward_mean)}"
                f"  cut {_share(self.cut.train_frac(name)):>4}"
                f"  acc@{self.acc_n.get(name, 0)} {_fmt(self.acc.get(name))}  {rate:6.1f} samples/s  staleness "
                f"{_fmt(r and r.staleness_mean, '.2f')}  peer recv {r.peer_total if r else 0} "
                f"used {r.peer_used if r else 0}")

    @staticmethod
    def legend(cfg) -> str:
        """What the live figures are, printed once above them."""
        return (f"cut: share of its own samples of the last {TRAIN_WINDOW_STEPS} steps that hit "
                f"train.max_new_tokens={cfg.train.max_new_tokens} without EOS; acc@N: held-out accuracy on N "
                f"distinct problems (the warm start's and the final table's on up to eval.num_problems="
                f"{cfg.eval.num_problems}, live on up to eval.live_problems={cfg.eval.live_problems}: a task with "
                "fewer has them all); "
                f"peer recv: peer samples received, used: read by the objective ({cfg.objective.kind}; the table's "
                "'peer exp. used')")

    def _render(self) -> Table:
        table = Table.grid()
        for name in self.names:
            table.add_row(self.line(name))
        return table

    def refresh(self, extra: str = "") -> None:
        if self.live:
            self.live.update(self._render())
        elif self.enabled and time.time() - self._last_plain >= self.plain_every_s:
            self._last_plain = time.time()
            for name in self.names:
                print(self.line(name), flush=True)
            if extra:
                print(extra, flush=True)

    def close(self) -> None:
        if self.live:
            self.live.update(self._render())
            self.live.stop()


def print_summary(cfg, preps, finals: dict, train_cut: dict | None = None) -> None:
    """Held-out accuracy before and after RL per model; ``finals`` maps a model to its LearnerFinal, ``train_cut``
    to the share of its training samples cut over its last steps (``engine.record.truncation``)."""
    table = Table(title=f"mutual RL summary (objective: {cfg.objective.kind})", caption=_cut_caption(cfg))
    for col in ("model", "warm-start acc", "after RL acc", "change (SE)", "cut (eval)", "cut (train)", "steps",
                "samples trained", "peer exp. used"):
        table.add_column(col, justify="right")
    for prep in preps:
        f = finals.get(prep.model)
        acc, se = (f.accuracy, f.accuracy_stderr) if f else (None, None)
        change = "-"
        if acc is not None:
            joint = ((se or 0) ** 2 + prep.warm_accuracy_stderr ** 2) ** 0.5
            delta = acc - prep.warm_accuracy
            change = f"{delta * 100:+.1f} pts ({delta / joint:+.1f})" if joint > 0 else f"{delta * 100:+.1f} pts"
        table.add_row(
            prep.model, f"{prep.warm_accuracy * 100:.1f}% ± {prep.warm_accuracy_stderr * 100:.1f}",
            "-" if acc is None else f"{acc * 100:.1f}% ± {(se or 0) * 100:.1f}", change,
            f"{_share(prep.warm_truncated)} → {_share(f and f.truncated)}", _share((train_cut or {}).get(prep.model)),
            str(f.step) if f else "-", str(f.own_total) if f else "-", str(f.peer_used) if f else "-")
    Console(width=max(Console().width, 132)).print(table)


def _share(frac: float | None) -> str:
    """A cut share in whole percent, never "0%" for a few cut: "<1%"."""
    return "-" if frac is None else "<1%" if 0 < frac < 0.005 else f"{frac:.0%}"


def _cut_caption(cfg) -> str:
    return (f"cut: no EOS by max_new_tokens (eval before → after RL: {eval_length_key(cfg)}="
            f"{cfg.eval_max_new_tokens}; train, last {TRAIN_WINDOW_STEPS} steps: "
            f"train.max_new_tokens={cfg.train.max_new_tokens})")
