"""What a person sees: one live line per model while the run goes, a summary table at the end.

On a terminal the lines redraw in place (rich); otherwise (CI, a log file) the same
lines are printed every ``plain_every_s`` seconds.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * min(done, total) / max(total, 1))
    return "█" * filled + "·" * (width - filled)


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class LiveDisplay:
    def __init__(self, cfg, preps, plain_every_s: float = 10.0):
        self.cfg = cfg
        self.names = [m.name for m in cfg.models]
        self.last: dict[str, dict] = {n: {} for n in self.names}
        self.acc: dict[str, float | None] = {p.model: p.warm_accuracy for p in preps}
        self.started = time.time()
        self.samples: dict[str, int] = {}
        self.console = Console(stderr=False)
        self.tty = sys.stdout.isatty()
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0
        self.live = Live(self._render(), console=self.console, refresh_per_second=2) if self.tty else None
        if self.live:
            self.live.start()

    def update(self, record: dict) -> None:
        name = record.get("model")
        if name not in self.last or record.get("event") not in ("step", "final"):
            return
        self.last[name] = {**self.last[name], **record}  # a final record keeps the last step's figures
        if record.get("accuracy") is not None:
            self.acc[name] = record["accuracy"]

    def line(self, name: str) -> str:
        r = self.last[name]
        step, steps = r.get("step", 0), self.cfg.train.steps
        elapsed = max(time.time() - self.started, 1e-9)
        rate = self.samples.get(name, 0) / elapsed
        return (f"{name:>14} {_bar(step, steps)} step {step:>4}/{steps}  reward {_fmt(r.get('reward_mean'))}"
                f"  acc {_fmt(self.acc.get(name))}  {rate:6.1f} samples/s  staleness {_fmt(r.get('staleness_mean'), '.2f')}"
                f"  peer {r.get('peer_experiences', 0)}")

    def _render(self) -> Table:
        table = Table.grid()
        for name in self.names:
            table.add_row(self.line(name))
        return table

    def refresh(self, samples: dict[str, int]) -> None:
        self.samples = dict(samples)
        if self.live:
            self.live.update(self._render())
        elif time.time() - self._last_plain >= self.plain_every_s:
            self._last_plain = time.time()
            for name in self.names:
                print(self.line(name), flush=True)

    def close(self) -> None:
        if self.live:
            self.live.update(self._render())
            self.live.stop()


def print_summary(cfg, preps, finals: dict[str, dict], samples: dict[str, int]) -> None:
    table = Table(title=f"mutual RL summary (objective: {cfg.objective.kind})")
    for col in ("model", "warm-start acc", "after RL acc", "change (SE)", "steps", "samples trained",
                "peer exp. used", "wall s"):
        table.add_column(col, justify="right")
    for prep in preps:
        f = finals.get(prep.model, {})
        acc, se = f.get("accuracy"), f.get("accuracy_stderr")
        if acc is None:
            change = "-"
        else:
            joint = ((se or 0) ** 2 + prep.warm_accuracy_stderr ** 2) ** 0.5
            delta = acc - prep.warm_accuracy
            change = f"{delta * 100:+.1f} pts ({delta / joint:+.1f})" if joint > 0 else f"{delta * 100:+.1f} pts"
        table.add_row(
            prep.model, f"{prep.warm_accuracy * 100:.1f}% ± {prep.warm_accuracy_stderr * 100:.1f}",
            "-" if acc is None else f"{acc * 100:.1f}% ± {(se or 0) * 100:.1f}", change,
            str(f.get("step", "-")), str(samples.get(prep.model, 0)), str(f.get("peer_used", "-")),
            str(f.get("wall_s", "-")),
        )
    Console(width=max(Console().width, 110)).print(table)
