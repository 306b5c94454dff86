"""The coordinator's bookkeeping of roles and learner groups (pure: no processes)."""

from __future__ import annotations

from engine.runtime.plane import Regroup
from engine.schedule.roster import Roster

SPLIT = {"w0": ("learner", "llama"), "w1": ("learner", "llama"), "w2": ("learner", "llama"),
         "w3": ("generator", "llama"), "w4": ("learner", "gpt2"), "w5": ("generator", "gpt2")}


def _roster() -> Roster:
    roster = Roster(["gpt2", "llama"])
    roster.start(dict(SPLIT), t0=0.0)
    return roster


def test_a_move_of_a_leader_goes_to_the_member_longest_in_its_role():
    roster = _roster()
    assert roster.leader("llama") == "w0"
    # MWRA moves the leader: w2 took its role a moment ago (inside its dwell), w1 long before
    applied, messages = roster.apply({"w0": ("generator", "gpt2")}, "test", moved_at={"w1": 10.0, "w2": 500.0})
    assert applied == {"w1": ("generator", "gpt2")}  # the leader stays; the settled member moves for it
    assert roster.groups["llama"].members == ["w0", "w2"] and roster.leader("llama") == "w0"
    assert {w for w, msg in messages if isinstance(msg, Regroup)} == {"w0", "w1", "w2"}


def test_without_dwell_times_the_stand_in_is_the_last_member():
    roster = _roster()
    applied, _ = roster.apply({"w0": ("generator", "gpt2")}, "test")
    assert applied == {"w2": ("generator", "gpt2")}
    roster = _roster()  # equal times: the last member, as without them
    applied, _ = roster.apply({"w0": ("generator", "gpt2")}, "test", moved_at={"w1": 5.0, "w2": 5.0})
    assert applied == {"w2": ("generator", "gpt2")}


def test_a_member_moved_in_the_same_decision_is_no_stand_in():
    roster = _roster()
    applied, _ = roster.apply({"w0": ("generator", "gpt2"), "w1": ("generator", "llama")}, "test",
                              moved_at={"w1": 0.0, "w2": 500.0})
    assert applied == {"w1": ("generator", "llama"), "w2": ("generator", "gpt2")}
    assert roster.groups["llama"].members == ["w0"]
