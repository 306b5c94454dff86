"""The weight channel (engine.weights.channel) between real processes: readers come and go, the writer
never waits, nobody sees half-written weights, and a dead process holds nothing."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine.record.rundir import SOCK_DIR_PREFIX, make_sock_dir
from engine.weights.channel import WeightReader, WeightSyncError, WeightWriter
from engine.weights.places import OWNER, channel_root

CTX = mp.get_context("spawn")


def _model(fill: float = 0.0, width: int = 8) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(50, width), torch.nn.Linear(width, 50))
    model[1].weight = model[0].weight  # tied, like the LMs: carried once
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _set(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _reader(directory: str, commands, out) -> None:
    """Load on every "load" command; report (version, the set of values in the weights)."""
    model = _model(fill=-1.0)
    reader = WeightReader(Path(directory), model)
    while (cmd := commands.get(timeout=60)) != "stop":
        if cmd == "load":
            version = reader.load()
            values = {float(v) for p in model.parameters() for v in p.detach().unique()}
            out.put((os.getpid(), version, sorted(values)))
    reader.close()


def _start_reader(directory):
    commands, out = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_reader, args=(str(directory), commands, out))
    proc.start()
    return proc, commands, out


def _load(commands, out) -> tuple[int, list[float]]:
    commands.put("load")
    try:
        _, version, values = out.get(timeout=60)
    except queue.Empty:
        pytest.fail("the reader process did not answer within 60 s")
    return version, values


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_readers_that_join_late_get_the_newest_exact_weights(tmp_path):
    directory = tmp_path / "gpt2"
    learner = _model(0.0)
    writer = WeightWriter(directory, learner)
    early = _start_reader(directory)
    try:
        assert _load(*early[1:]) == (0, [-1.0])  # nothing published: the reader keeps what it has
        seen = []
        for v in range(1, 6):
            _set(learner, float(v))
            writer.publish(v)
            seen.append(_load(*early[1:]))
        assert seen == [(v, [float(v)]) for v in range(1, 6)]  # every version whole, in order
        late = _start_reader(directory)
        try:
            assert _load(*late[1:]) == (5, [5.0])  # a reader that joins gets the newest before anything else
            _set(learner, 6.0)
            writer.publish(6)
            assert _load(*late[1:]) == (6, [6.0]) and _load(*early[1:]) == (6, [6.0])
        finally:
            late[1].put("stop")
            late[0].join(30)
    finally:
        early[1].put("stop")
        early[0].join(30)
        writer.close()


def test_the_writer_never_touches_a_slot_a_reader_holds_and_a_dead_reader_holds_nothing(tmp_path):
    directory = tmp_path / "llama"
    learner = _model(1.0)
    writer = WeightWriter(directory, learner)
    writer.publish(1)
    holder = _start_reader(directory)
    try:
        assert _load(*holder[1:]) == (1, [1.0])  # it now views version 1's slot, zero copy
        for v in range(2, 12):  # many versions while it holds on: its weights must not change under it
            _set(learner, float(v))
            writer.publish(v)
        slots = sorted(p.name for p in directory.glob("slot-*"))
        assert len(slots) <= 3, slots  # a held slot, the head's, one to pack into: the writer cycles
        os.kill(holder[0].pid, signal.SIGKILL)
        holder[0].join(30)
        for v in range(12, 20):  # the dead reader's lock went with it: its slot is reused, nothing grows
            _set(learner, float(v))
            writer.publish(v)
        assert len(list(directory.glob("slot-*"))) <= 3
        fresh = _start_reader(directory)
        try:
            assert _load(*fresh[1:]) == (19, [19.0])
        finally:
            fresh[1].put("stop")
            fresh[0].join(30)
    finally:
        if holder[0].is_alive():
            holder[0].kill()
        writer.close()


def test_a_held_reader_keeps_its_version_while_versions_pass(tmp_path):
    learner, generator = _model(1.0), _model(-1.0)
    writer, reader = WeightWriter(tmp_path, learner), WeightReader(tmp_path, generator)
    writer.publish(1)
    assert reader.load() == 1
    for v in range(2, 8):
        _set(learner, float(v))
        writer.publish(v)
        assert {float(x) for p in generator.parameters() for x in p.detach().unique()} == {1.0}
    assert reader.load() == 7 and all(torch.equal(a, b) for a, b in zip(generator.parameters(), learner.parameters()))
    reader.close(detach=True)  # private copies: a later learner role may train on them
    _set(learner, 9.0)
    writer.publish(9)
    assert all(float(p.detach().unique()) == 7.0 for p in generator.parameters())
    writer.close()


def test_a_slot_torn_by_a_dead_writer_is_never_loaded(tmp_path):
    learner, generator = _model(1.0), _model(-1.0)
    writer, reader = WeightWriter(tmp_path, learner), WeightReader(tmp_path, generator)
    writer.publish(1)
    _set(learner, 2.0)
    writer.publish(2)
    _, head_slot = writer.slots.head()
    torn = next(s for s in writer.slots.existing() if s != head_slot)
    writer.slots.set_stamp(torn, -1)  # a writer that died while packing `torn` (head still names the good slot)
    assert reader.load() == 2 and all(float(p.detach().unique()) == 2.0 for p in generator.parameters())
    os.replace(tmp_path / "head", tmp_path / "head.bak")
    os.symlink(f"3:{torn}", tmp_path / "head")  # a head that names a torn slot (never written so): an error, no hang
    with pytest.raises(WeightSyncError, match="never holds"):
        reader.load()
    writer.close()


def test_the_copy_path_for_weights_on_a_device_loads_exact_weights(tmp_path):
    learner, generator = _model(3.0), _model(-1.0)
    writer, reader = WeightWriter(tmp_path, learner), WeightReader(tmp_path, generator)
    reader.zero_copy = False  # what a GPU reader does: copy, and release the slot at once
    writer.publish(4)
    assert reader.load() == 4 and all(float(p.detach().unique()) == 3.0 for p in generator.parameters())
    assert all(p.untyped_storage().nbytes() < 50 * 8 * 4 * 2 for p in generator.parameters())  # not slot views
    writer.close()


def test_a_reader_of_another_model_shape_is_told_why(tmp_path):
    writer = WeightWriter(tmp_path, _model(1.0, width=8))
    writer.publish(1)
    reader = WeightReader(tmp_path, _model(0.0, width=16))
    with pytest.raises(WeightSyncError, match="different model specs"):
        reader.load()
    writer.close()


def _channels(tag: str):
    """The stem of stale folders of this kind, and a new run's claim of its own."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"mutual-rl-test-{tag}", lambda: channel_root(f"test-{tag}-mine")


def _sockets(tag: str):
    return Path(tempfile.gettempdir()) / f"{SOCK_DIR_PREFIX}test-{tag}", make_sock_dir


CLAIMS_A_CHANNEL = """
import sys, torch
from engine.weights.channel import WeightWriter
from engine.weights.places import channel_root
root = channel_root(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
writer = WeightWriter(root, model)
writer.publish(1)
print(root, flush=True)
sys.stdin.read()  # until it is killed
"""


def test_a_sigkilled_runs_channel_stays_until_the_next_run_removes_it():
    """Issue 58: a coordinator SIGKILLed (a whole run killed: nothing of it can clean up) leaves its channel, the
    model's weights in shared memory; the next run on the host removes it when it claims its own."""
    tag = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.Popen([sys.executable, "-c", CLAIMS_A_CHANNEL, f"test-{tag}-killed"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mine = None
    try:
        root = Path(killed.stdout.readline().strip())
        assert root.name == f"mutual-rl-test-{tag}-killed" and (root / OWNER).read_text() == str(killed.pid)
        held = [f for f in root.rglob("*") if f.is_file() and f.name != OWNER]
        assert held and sum(f.stat().st_size for f in held) > 50 * 8 * 4  # the published weights
        killed.kill()
        killed.wait(timeout=30)
        assert root.is_dir()  # nothing of a killed run removes it
        mine = channel_root(f"test-{tag}-next")  # the next run's claim
        assert not root.exists(), "the next run did not remove a killed run's channel"
    finally:
        killed.kill()
        killed.wait(timeout=30)
        for stale in Path(tempfile.gettempdir()).glob(f"mutual-rl-test-{tag}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in Path("/dev/shm").glob(f"mutual-rl-test-{tag}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if mine is not None:
            shutil.rmtree(mine, ignore_errors=True)


@pytest.mark.parametrize("kind", [_channels, _sockets], ids=["channels", "sockets"])
def test_a_run_removes_the_folders_of_a_dead_coordinator_and_keeps_a_live_ones(kind):
    """A coordinator killed with all its processes (a process group's SIGKILL) cannot remove its channels (a whole
    model in RAM) or its socket folder, nor can its actors: the next run on the host does, and leaves alone those
    of a coordinator still alive and a folder without an owner file."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    stem, claim = kind(uuid.uuid4().hex[:8])
    dead, live, unowned = (Path(f"{stem}-{n}") for n in ("dead", "live", "unowned"))
    for root, owner in ((dead, gone.pid), (live, os.getpid()), (unowned, None)):
        root.mkdir()
        (root / "slot").write_bytes(b"w")
        if owner is not None:
            (root / OWNER).write_text(str(owner))
    mine = claim()
    try:
        assert not dead.exists()
        assert (live / "slot").exists() and (unowned / "slot").exists()
        assert (mine / OWNER).read_text() == str(os.getpid())
    finally:
        for root in (dead, live, unowned, mine):
            shutil.rmtree(root, ignore_errors=True)
