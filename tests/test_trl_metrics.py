"""A step's figures under TRL's names (engine/train/trl_metrics.py), on samples whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.train.batching import OwnSample
from engine.train.trl_metrics import trl_step_metrics


def _sample(prompt: int, reward: float, n: int, finished: bool = True, parts=()) -> OwnSample:
    return OwnSample(prompt_ids=np.zeros(3, np.int64), completion_ids=np.ones(n, np.int64),
                     behaviour_logprobs=np.full(n, -0.5, np.float32), reward=reward, verified=reward > 0,
                     weight_version=0, prompt_id=prompt, reward_parts=list(parts), finished=finished)


def test_rewards_lengths_entropy_and_clip_sides_under_trls_names():
    own = [_sample(0, 1.0, 4, parts=(1.0, 0.0)), _sample(0, 0.0, 6, parts=(0.0, math.nan)),
           _sample(1, 0.0, 10, finished=False, parts=(0.0, 0.5)), _sample(1, 0.0, 2, parts=(0.0, 0.5))]
    got = trl_step_metrics(own, 1e-5, {"obj/clip_frac": 0.3, "obj/clip_low_frac": 0.1, "obj/clip_high_frac": 0.2},
                           ["correct", "short"])
    assert got["reward"] == 0.25 and got["reward_std"] == pytest.approx(0.5)  # n - 1, as TRL's nanstd
    assert got["frac_reward_zero_std"] == 0.5  # prompt 1's group all 0: no signal
    assert got["rewards/correct/std"] == pytest.approx(0.5) and got["rewards/short/std"] == pytest.approx(0.2887, 1e-3)
    assert (got["completions/mean_length"], got["completions/min_length"], got["completions/max_length"]) == (5.5, 2, 10)
    assert got["completions/clipped_ratio"] == 0.25  # cut at max_new_tokens
    assert got["completions/max_terminated_length"] == 6 and got["completions/mean_terminated_length"] == 4
    assert got["entropy"] == pytest.approx(0.5) and got["learning_rate"] == 1e-5
    assert (got["clip_ratio/low_mean"], got["clip_ratio/high_mean"], got["clip_ratio/region_mean"]) == (0.1, 0.2, 0.3)
    assert trl_step_metrics([], 1e-5, {})["reward"] is None  # an empty step says nothing, and does not raise
