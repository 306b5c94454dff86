"""Completions cut at max_new_tokens, watched per model, so that a cap never turns learning into loss unseen.

RL changes how a model answers before what it knows: SmolLM2 learned to work sums out, a 16-token cap cut the
worked sums, and the evaluation read the last number of a cut equation as the answer. When more than a fifth of
a model's completions are cut (an evaluation's, or its training samples' over its last TRAIN_WINDOW_STEPS steps),
the coordinator says so in one line on stderr and a ``truncation`` record in metrics.jsonl, once per model and
kind ("eval", "train"): the figures that follow still show the fraction (live line, final table, report).
"""

from __future__ import annotations

import collections
import sys

WARN_ABOVE = 0.2  # past a fifth cut, the cap rather than the model decides what is measured
TRAIN_WINDOW_STEPS = 10  # a training figure spans this many steps (each trains the same number of own samples)


def eval_length_key(cfg) -> str:
    """The setting an evaluation's length comes from (``RunConfig.eval_max_new_tokens``)."""
    return "eval.max_new_tokens" if cfg.eval.max_new_tokens else "train.max_new_tokens"


WHY = {"eval": "the accuracy judged cut answers", "train": "RL learns what fits the cap, not what solves"}


def warning_line(model: str, kind: str, frac: float, what: str, key: str, length: int) -> str:
    return (f"warning: {model}: {frac:.0%} of its {what} hit {key}={length} without EOS, so {WHY[kind]}; "
            f"raise it (e.g. --set {key}={2 * length})")


class CutWatch:
    """Fed the warm starts' evaluations, every learner step (``LiveDisplay`` owns it) and every final
    (``engine.outcome``). ``say(text, err)`` prints (default: stderr); ``metrics`` (None: no record)."""

    def __init__(self, cfg, metrics=None, say=None, preps=()) -> None:
        self.cfg, self.metrics, self.say = cfg, metrics, say or _stderr
        self.recent = {m: collections.deque(maxlen=TRAIN_WINDOW_STEPS) for m in cfg.names}
        self.warned: set[tuple[str, str]] = set()
        for p in preps:
            if p.warm_truncated is not None:  # None: an eval cache older than the count
                self.evaluated(p.model, p.warm_truncated, "evaluation after the warm start")

    def stepped(self, model: str, step: int, report) -> None:
        self.recent[model].append(report.truncated_frac)
        if len(self.recent[model]) == TRAIN_WINDOW_STEPS:
            self._trained(model)
        if report.eval_truncated is not None:
            self.evaluated(model, report.eval_truncated, f"live evaluation at step {step}")

    def finished(self, final) -> None:
        if self.recent[final.model]:  # a run shorter than the window is judged on the steps it took
            self._trained(final.model)
        if final.truncated is not None:
            self.evaluated(final.model, final.truncated, "final evaluation")

    def train_frac(self, model: str) -> float | None:
        """Share of the model's own samples cut over its last TRAIN_WINDOW_STEPS steps (None before a step)."""
        recent = self.recent.get(model)
        return sum(recent) / len(recent) if recent else None

    def evaluated(self, model: str, frac: float, where: str) -> None:
        key = eval_length_key(self.cfg)
        self._check(model, "eval", frac, f"completions in the {where}", key, self.cfg.eval_max_new_tokens)

    def _trained(self, model: str) -> None:
        what = f"training samples over its last {len(self.recent[model])} steps"
        self._check(model, "train", self.train_frac(model), what, "train.max_new_tokens",
                    self.cfg.train.max_new_tokens)

    def _check(self, model: str, kind: str, frac: float, what: str, key: str, length: int) -> None:
        if frac <= WARN_ABOVE or (model, kind) in self.warned:
            return
        self.warned.add((model, kind))
        self.say(warning_line(model, kind, frac, what, key, length), err=True)
        if self.metrics is not None:
            self.metrics.write(event="truncation", model=model, kind=kind, frac=round(frac, 4), what=what, key=key,
                               max_new_tokens=length)


def _stderr(text: str, err: bool = True) -> None:
    print(text, file=sys.stderr, flush=True)
