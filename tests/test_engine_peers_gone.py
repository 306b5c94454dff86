"""What a learner says when a peer is gone (the run-level paths: tests/test_engine_run.py, tests/test_engine_pool.py).

A 6-step run printed "training solo from step 7" when its peer finished first and the news reached the learner at
its last step: a model at its last step trains nothing more, so nothing is said there. The race that brought it
is a run's timing; the rule is checked here, where it is exact."""

from __future__ import annotations

from engine.roles.learner_core import newly_gone

GONE = {"llama": "finished its 6 steps", "qwen": "its last learner (w5) exited with code -9"}


def test_a_peer_gone_at_the_models_last_step_is_not_announced():
    assert newly_gone(GONE, set(), ["llama"], version=6, steps=6) == []
    assert newly_gone(GONE, set(), ["llama"], version=7, steps=6) == []  # a resumed run past its steps, too


def test_a_peer_gone_before_the_last_step_is_announced_once_and_only_a_peer():
    assert newly_gone(GONE, set(), ["llama"], version=5, steps=6) == ["llama"]  # "training solo from step 6"
    assert newly_gone(GONE, {"llama"}, ["llama"], version=5, steps=6) == []  # said once
    assert newly_gone(GONE, set(), ["llama", "qwen"], version=0, steps=6) == ["llama", "qwen"]
    assert newly_gone({}, set(), ["llama"], version=2, steps=6) == []
