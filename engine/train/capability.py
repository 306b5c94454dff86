"""HACPO's capability of each model (``policies/hacpo.py``): its share of samples with reward > 0 in a learner
step, averaged over its last ``window`` steps, this one included (the recipe's ``CapabilityTracker``).

Each learner rank keeps one over whole steps (``TrainState.capability``) and updates it once a step, before the
step is cut into pieces, so every piece of every rank reads the same figures. A model with no sample in a step
keeps its window as it was; one never seen counts 1.0, as in the recipe. The window starts empty at a resume.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

FLOOR = 1e-8  # the recipe's: a model that solved nothing in its window still divides


class Capability(NamedTuple):
    own: float  # the receiver's
    peers: dict[str, float]  # each peer model's, by name


class CapabilityWindow:
    def __init__(self, window: int):
        self.rates: dict[str | None, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=window))

    def update(self, own: list, peers: list) -> Capability:
        """Take one step's own samples and peer samples (with ``reward`` and, for peers, ``model``)."""
        by_model: dict[str | None, list[float]] = {None: [s.reward for s in own]}
        for p in peers:
            by_model.setdefault(p.model, []).append(p.reward)
        for model, rewards in by_model.items():
            if rewards:
                self.rates[model].append(max(sum(r > 0 for r in rewards) / len(rewards), FLOOR))
        return Capability(self._mean(None), {m: self._mean(m) for m in self.rates if m is not None})

    def _mean(self, model: str | None) -> float:
        rates = self.rates.get(model)
        return sum(rates) / len(rates) if rates else 1.0
