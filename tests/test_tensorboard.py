"""The learners' TensorBoard event files, read back by TensorBoard's own loader (a test-only dependency)."""

from __future__ import annotations

import pytest

from engine.record.tbevents import EventWriter

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_every_number_of_a_record_is_a_scalar_tensorboard_reads(tmp_path):
    w = EventWriter(tmp_path / "gpt2")
    w.scalars(0, {"warm_accuracy": 0.25})
    for step in (1, 2, 3):
        w.scalars(step, {"reward_mean": 0.1 * step, "obj/loss": -step, "accuracy": 0.5, "solo": True,
                         "peers_gone": [], "thl_residual_mean": None, "nan": float("nan"), "step": step})
    w.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "gpt2"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"reward_mean", "obj/loss", "eval/accuracy", "eval/warm_accuracy"}  # no bool, list, None, NaN
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in acc.Scalars("obj/loss")] == [-1.0, -2.0, -3.0]
