"""A step's figures under the names TRL's GRPOTrainer logs, where they mean the same: what a TRL user reads first
when a run goes wrong (its reward spread, how long its completions are and how many the cap cut, the learning
rate, the policy's entropy, how much the clip bit).

Two differ in how they are had, not in what they mean:
- ``entropy``: TRL computes it exactly from the logits of the trained forward; here it is estimated from the sampled
  tokens, the mean of ``-log p`` of each completion token under the distribution it was sampled from (an unbiased
  estimate of that distribution's entropy per token), so no step holds a vocabulary's worth of probabilities.
- ``clip_ratio/*``: over the learner's own fresh tokens (the objective's ``clip_frac`` is the region's share).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def trl_step_metrics(own: Sequence, lr: float, stats: dict, names: Sequence[str] = ()) -> dict[str, float | None]:
    """``own``: the step's own samples (``engine.train.batching.OwnSample``); ``stats``: the step's ``obj/*``
    figures; ``names``: the reward functions' logged names, in ``reward_parts`` order."""
    rewards = [s.reward for s in own]
    out: dict[str, float | None] = {"reward": _mean(rewards), "reward_std": _std(rewards),
                                    "frac_reward_zero_std": _zero_std_share(own), "learning_rate": lr}
    for i, name in enumerate(names):
        judged = [s.reward_parts[i] for s in own if len(s.reward_parts) > i and not math.isnan(s.reward_parts[i])]
        out[f"rewards/{name}/std"] = _std(judged)
    lengths = [len(s.completion_ids) for s in own]
    finished = [n for n, s in zip(lengths, own) if s.finished]
    out.update({"completions/mean_length": _mean(lengths), "completions/min_length": _min(lengths),
                "completions/max_length": _max(lengths),
                "completions/clipped_ratio": _mean([float(not s.finished) for s in own]),
                "completions/mean_terminated_length": _mean(finished),
                "completions/min_terminated_length": _min(finished),
                "completions/max_terminated_length": _max(finished)})
    tokens = sum(lengths)
    out["entropy"] = -sum(float(s.behaviour_logprobs.sum()) for s in own) / tokens if tokens else None
    for trl, ours in (("clip_ratio/low_mean", "obj/clip_low_frac"), ("clip_ratio/high_mean", "obj/clip_high_frac"),
                      ("clip_ratio/region_mean", "obj/clip_frac")):
        if ours in stats:
            out[trl] = stats[ours]
    return out


def _zero_std_share(own: Sequence) -> float | None:
    """The share of the step's groups (own samples of one prompt) whose rewards are all the same: no signal."""
    groups: dict[int, set[float]] = defaultdict(set)
    for s in own:
        groups[s.prompt_id].add(s.reward)
    return sum(len(r) == 1 for r in groups.values()) / len(groups) if groups else None


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: Sequence[float]) -> float | None:
    """The sample standard deviation (n - 1), as TRL's ``nanstd``."""
    if len(xs) < 2:
        return 0.0 if xs else None
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _min(xs: Sequence[float]) -> float | None:
    return float(min(xs)) if xs else None


def _max(xs: Sequence[float]) -> float | None:
    return float(max(xs)) if xs else None
