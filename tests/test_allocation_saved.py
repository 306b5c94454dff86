"""allocation.json: what a resumed run takes back of who did what (pure: no processes).

The engine-level check, a scripted split that survives ``launch.py resume``, is in tests/test_resume.py.
"""

from __future__ import annotations

import json
import math

from test_controller import stats_for

from engine.config import ScriptedMove, load_run_config
from engine.schedule.allocator import ALLOCATION, MWRAAllocator, Script, load_allocation, make_allocator
from tests.enginerun import ROOT

WORKERS = ["w0", "w1", "w2", "w3", "w4", "w5"]
# llama's generators are the slowest pool by far: MWRA moves a gpt2 generator to them at its first decision
CAP = {("generator", "gpt2"): 8.0, ("learner", "gpt2"): 8.0, ("generator", "llama"): 0.5, ("learner", "llama"): 8.0}


def _mwra(run_dir):
    move = "{step_of = 'gpt2', at_step = 1, worker = 'w5', role = 'generator', model = 'gpt2'}"
    cfg = load_run_config(str(ROOT / "configs/smoke.toml"), ["pool.allocator='mwra'", "pool.workers=6",
                                                             f"pool.script=[{move}]"])
    return cfg, make_allocator(cfg, run_dir)


def test_a_recalled_controller_decides_as_the_one_that_was_stopped(tmp_path):
    cfg, first = _mwra(tmp_path)
    assignment = first.initial(WORKERS)
    for now in (100.0, 110.0):  # estimates of every pool and a move, then "balanced"
        changes, _, _ = first.tick(now, stats_for(assignment, CAP, now), assignment)
        assignment.update(changes)
    assert first.state.capacity and first.state.moved_at == {"w0": 100.0}  # something to remember
    assert first.script.due({"gpt2": 1}) and first.script.fired == [0]
    first.keep(assignment)

    second = MWRAAllocator(cfg, tmp_path)
    said = second.recall()
    assert said.startswith("workers take the roles they had when the run stopped: w0 generator:llama"), said
    assert second.initial(WORKERS) == assignment != first.first_split(WORKERS)
    assert second.script.fired == [0] and second.script.due({"gpt2": 5}) == []
    assert second.state == first.state
    assert second.state.last_move_at == 100.0 and math.isinf(MWRAAllocator(cfg).state.last_move_at)
    now = 113.0  # inside the cooldown after the move, so both must say so; then past it, with new estimates
    CAP2 = {**CAP, ("generator", "llama"): 8.0, ("generator", "gpt2"): 0.5}  # the costs swap
    moved = []
    for now, cap in ((113.0, CAP), (130.0, CAP2), (140.0, CAP2), (150.0, CAP2)):
        a, b = (alloc.tick(now, stats_for(assignment, cap, now), dict(assignment)) for alloc in (first, second))
        assert a == b  # the same moves, reasons and records
        assignment.update(a[0])
        moved += a[0]
    assert moved, "the swap of costs moved nobody: the comparison above compared no-ops only"


def test_a_fresh_controller_state_round_trips_its_infinite_times(tmp_path):
    cfg, alloc = _mwra(tmp_path)
    alloc.keep(alloc.initial(WORKERS))
    assert "-Infinity" in (tmp_path / ALLOCATION).read_text()  # never decided yet
    other = MWRAAllocator(cfg, tmp_path)
    assert other.recall().startswith("workers take the roles")
    assert other.state == alloc.state and other.initial(WORKERS) == alloc.initial(WORKERS)


def test_the_file_is_rewritten_only_when_something_changed(tmp_path):
    cfg, alloc = _mwra(tmp_path)
    split = alloc.initial(WORKERS)
    alloc.keep(split)
    (tmp_path / ALLOCATION).unlink()
    alloc.keep(split)
    assert not (tmp_path / ALLOCATION).exists()  # nothing new: not written again
    alloc.keep({**split, "w0": ("idle", "")})
    assert json.loads((tmp_path / ALLOCATION).read_text())["assignment"]["w0"] == ["idle", ""]


def test_a_recalled_script_does_not_fire_again():
    moves = [ScriptedMove(at_step=1, step_of="gpt2", worker="w0", role="generator", model="llama"),
             ScriptedMove(at_step=3, step_of="gpt2", worker="w1", role="generator", model="gpt2")]
    script = Script(moves)
    script.fired = [0]
    assert script.due({"gpt2": 2}) == []
    assert script.due({"gpt2": 3}) == [moves[1]] and script.fired == [0, 1]


def _unfit(tmp_path, assignment, workers=None) -> str:
    (tmp_path / ALLOCATION).write_text(json.dumps({"assignment": assignment}))
    saved, said = load_allocation(tmp_path, workers or sorted(assignment), ["gpt2", "llama"])
    assert saved is None and said.endswith("workers start from the config's split"), said
    return said


def test_an_allocation_that_does_not_fit_the_run_is_set_aside_with_the_reason(tmp_path):
    full = {"w0": ["generator", "gpt2"], "w1": ["generator", "llama"], "w2": ["learner", "gpt2"],
            "w3": ["learner", "llama"]}
    assert load_allocation(tmp_path, list(full), ["gpt2", "llama"])[1].startswith("no saved allocation")
    assert "this run has ['w0', 'w1', 'w2', 'w3', 'w4']" in _unfit(tmp_path, full, [*full, "w4"])
    assert "llama has no learner" in _unfit(tmp_path, {**full, "w3": ["idle", ""]})
    assert "w1 has the role generator:qwen" in _unfit(tmp_path, {**full, "w1": ["generator", "qwen"]})
    assert "w2 has the role teacher:gpt2" in _unfit(tmp_path, {**full, "w2": ["teacher", "gpt2"]})
    (tmp_path / ALLOCATION).write_text('{"assignment": {"w0": ["gen')  # torn
    saved, said = load_allocation(tmp_path, list(full), ["gpt2", "llama"])
    assert saved is None and "unreadable" in said and ALLOCATION in said
