"""benchmarks.memory: its readings of real processes (as psutil reads them, split by kind of page), the roles it
gives them from a run directory's records, the peak and its attribution over processes and roles, and the
component arithmetic; one real tiny run (slow). The figures themselves are in docs/guides/memory.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.memory import breakdown, mib, summarise
from benchmarks.smaps import MIB, PARTS, RunRoles, TreeMemory, read_smaps, split

ROOT = Path(__file__).resolve().parents[1]
HOLD = 48 * MIB  # what each test process writes to, so that its pages are resident

# A process that names itself like an actor (prctl, as engine.runtime.actors does), holds HOLD bytes and, with
# FORK set, forks a child that holds nothing of its own: its pages are its parent's, shared copy-on-write.
PROCESS = textwrap.dedent("""
    import ctypes, os, sys, time
    name, fork = sys.argv[1], sys.argv[2] == "1"
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()), 0, 0, 0)
    held = bytearray(os.urandom(16) * ({hold} // 16))
    if fork and os.fork() == 0:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"mrl-w1"), 0, 0, 0)
    os.write(1, b"ready\\n")  # from each process: one write, whole in the pipe
    time.sleep(120)
""").format(hold=HOLD)


def spawn(name: str, fork: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PROCESS, name, "1" if fork else "0"], stdout=subprocess.PIPE,
                            text=True)
    for _ in range(2 if fork else 1):  # the fork, named, holds its pages too
        assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield lambda *a, **k: started.append(spawn(*a, **k)) or started[-1]
    for proc in started:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def test_a_reading_is_psutils_split_by_kind_of_page(processes):
    proc = processes("mrl-broker")
    mem = split(read_smaps(proc.pid))
    full = psutil.Process(proc.pid).memory_full_info()
    for key in ("pss", "rss", "uss"):  # the same kernel counters (a quiet process: they do not move between reads)
        assert abs(mem[key] - getattr(full, key)) <= MIB, (key, mem[key], getattr(full, key))
    assert sum(mem[k] for k in PARTS) == mem["pss"]  # every page counted once, in one part
    assert mem["private"] >= HOLD and mem["libraries"] > 0 and mem["inherited"] == 0  # not a fork: nothing shared


def test_pages_shared_with_a_fork_count_half_in_each_as_inherited(processes):
    parent = processes("forksrv", fork=True)
    child = psutil.Process(parent.pid).children()[0].pid
    mine, its = split(read_smaps(parent.pid)), split(read_smaps(child))
    # the fork wrote nothing: HOLD is shared, so PSS counts half of it in each, as inherited in the fork
    assert its["inherited"] >= HOLD / 2 * 0.9 and its["private"] < HOLD / 4
    assert mine["inherited"] >= HOLD / 2 * 0.9
    assert its["rss"] - its["uss"] >= HOLD  # RSS counts the shared pages whole: the point of PSS


def _records(run_dir: Path, *records: dict, partial: str = "") -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps({"time": time.time(), "model": "engine", **r}) + "\n" for r in records) + partial)


def test_roles_come_from_names_pids_and_the_role_records(tmp_path):
    (tmp_path / "pids.json").write_text(json.dumps({"broker": 11, "w0": 12, "w1": 13, "w2": 14, "w3": 15}))
    _records(tmp_path, {"event": "allocation", "workers": {"w0": ["generator", "smollm2"], "w1": ["learner", "smollm2"],
                                                           "w2": ["learner", "smollm2"], "w3": ["idle", ""]}})
    roles = RunRoles(tmp_path, launcher=10, models=["smollm2", "llama"])
    roles.update()
    assert roles.label(10, "python", "launch.py run") == ("coordinator", "launcher")
    assert roles.label(11, "mrl-broker", "")[0] == "broker"
    assert roles.label(12, "mrl-w0", "")[0] == "generator:smollm2"
    assert [roles.label(p, "", "")[0] for p in (13, 14)] == ["learner:smollm2 rank 0", "learner:smollm2 rank 1"]
    assert roles.label(15, "mrl-w3", "")[0] == "idle"
    assert roles.label(20, "mrl-prep-smollm", "") == ("prep:smollm2", "prep-smollm2")  # the kernel keeps 15 bytes
    assert roles.label(21, "python", "python -c from multiprocessing.forkserver import main")[0] == "fork server"
    # a move re-forms the group (its member order is the ranks'); a switch is the role the process holds now;
    # a line still being written is read once whole
    _records(tmp_path, {"event": "assign", "changes": {"w1": ["generator", "smollm2"]}, "groups": {"smollm2": ["w2"]}},
             {"event": "role_switch", "worker": "w3", "to_role": "learner", "to_model": "llama"},
             partial='{"time": 1, "event": "role_switch", "worker": "w0", "to_')
    roles.update()
    assert [roles.label(p, "", "")[0] for p in (12, 13, 14, 15)] == ["generator:smollm2", "generator:smollm2",
                                                                     "learner:smollm2 rank 0", "learner:llama rank 0"]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('role": "idle", "to_model": ""}\n')
    roles.update()
    assert roles.label(12, "", "")[0] == "idle"


def test_the_peak_is_the_sum_of_its_processes_and_of_its_roles(tmp_path, processes):
    """A tree of real processes (this test's process as the launcher, a broker, a fork server with one fork),
    sampled as a run's is."""
    broker, server = processes("mrl-broker"), processes("forksrv", fork=True)
    worker = psutil.Process(server.pid).children()[0].pid
    (tmp_path / "pids.json").write_text(json.dumps({"broker": broker.pid, "w1": worker}))
    _records(tmp_path, {"event": "allocation", "workers": {"w1": ["generator", "gpt2"]}})
    tree = TreeMemory(os.getpid(), RunRoles(tmp_path, os.getpid(), ["gpt2"]), every_s=0.05)
    deadline = time.monotonic() + 60  # three readings, however long a reading takes on a busy machine
    while len(tree.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    samples = tree.stop()
    assert len(samples) >= 3, f"{len(samples)} readings in 60 s"
    summary = summarise(samples)
    at_peak = [p for p in summary["per_process"] if "at_peak" in p]
    assert summary["peak_pss"] == sum(p["at_peak"]["pss"] for p in at_peak)
    assert summary["peak_pss"] == sum(r["at_peak"]["pss"] for r in summary["roles"].values())
    assert summary["peak_pss"] == max(sum(r.mem["pss"] for r in s.readings) for s in samples)
    named = {r: v for r, v in summary["roles"].items() if r in ("broker", "generator:gpt2", "coordinator")}
    assert set(named) == {"broker", "generator:gpt2", "coordinator"}
    assert all(v["at_peak"]["pss"] > 0 and v["peak_pss"] >= v["at_peak"]["pss"] for v in named.values())
    assert summary["roles"]["generator:gpt2"]["at_peak"]["inherited"] >= HOLD / 2 * 0.9  # shared with its server
    for p in at_peak:
        assert p["peak_pss"] >= p["at_peak"]["pss"]


def test_the_breakdown_splits_a_roles_private_pages_into_what_it_holds_and_the_rest():
    w, moments = 100 * MIB, 200 * MIB
    parts = {"models": {"m": {"weights": {"bytes": w}, "learner_step": {"optimizer_state_bytes": moments}}}}
    at = {"pss": 0, "rss": 0, "uss": 0, **dict.fromkeys(PARTS, 0)}
    # two ranks: their weights are the checkpoint's mapped pages (written by the optimizer: their own copies)
    learner = {**at, "pss": 2 * 700 * MIB, "private": 2 * 500 * MIB, "inherited": 2 * 60 * MIB,
               "libraries": 2 * 40 * MIB, "checkpoint": 2 * w}
    roles = {"learner:m rank 0": {"processes": 2, "peak_pss": 0, "at_peak": learner},
             "generator:m": {"processes": 1, "peak_pss": 0, "at_peak": {**at, "pss": 300 * MIB, "private": 200 * MIB,
                                                                         "channel": 100 * MIB}},
             "prep:m": {"processes": 1, "peak_pss": 0, "at_peak": {**at, "pss": 150 * MIB, "private": 150 * MIB}},
             "gone:m": {"processes": 0, "peak_pss": 0, "at_peak": at}}  # not alive at the peak: no row
    rows = breakdown(roles, parts)
    assert set(rows) == {"learner:m rank 0", "generator:m", "prep:m"}
    assert rows["learner:m rank 0"] == {"processes": 2, "pss": 700.0, "libraries": 40.0, "inherited": 60.0,
                                        "channel": 0.0, "checkpoint": 100.0, "files": 0.0, "private": 500.0,
                                        "weights": 0.0, "gradients": 100.0, "adamw": 200.0,
                                        "private_rest": 200.0}  # per process: 500 - 100 - 200
    assert rows["generator:m"]["private_rest"] == 200.0 and "weights" not in rows["generator:m"]  # in its channel
    assert rows["prep:m"]["weights"] == 100.0 and rows["prep:m"]["private_rest"] == 50.0  # read, not mapped
    assert mib({"pss": 3 * MIB, "pid": 7, "samples": 32, "seconds": 1.5, "x": [MIB]}) == \
        {"pss": 3.0, "pid": 7, "samples": 32, "seconds": 1.5, "x": [1.0]}


@pytest.mark.slow
def test_a_tiny_run_has_every_role_and_its_peak_is_its_processes_sum(tmp_path, engine_cache):
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--config", "configs/smoke.toml",
                           "--all-models", "--steps", "3", "--no-components",
                           "--set", f"run.cache_dir='{engine_cache}'", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    seen = {r for p in result["per_process"] for r in p["roles"]}
    # (each model's prep process, its cached warm start and evaluation, may come and go between two readings)
    for role in ("coordinator", "fork server", "broker", "generator:gpt2", "generator:llama", "learner:gpt2 rank 0",
                 "learner:llama rank 0"):
        assert role in seen and role in result["roles"], role
        assert result["roles"][role]["peak_pss"] > 0, role
    at_peak = [p["at_peak"]["pss"] for p in result["per_process"] if "at_peak" in p]
    assert abs(sum(at_peak) - result["peak_pss_mib"]) <= 0.1 * len(at_peak)  # each rounded to 0.1 MiB


def test_as_configured_runs_the_config_as_it_is_and_a_kept_run_dir_must_be_new(tmp_path, capsys):
    from benchmarks.memory import main, parser, setup

    args = parser().parse_args(["--config", "configs/two_families.toml", "--as-configured", "--set", "train.steps=3"])
    tree = setup(args)
    assert tree["train"]["steps"] == 3 and tree["run"]["max_minutes"] == 20.0  # its minutes, not the benchmark's
    assert tree["eval"]["num_problems"] == 1000 and [m["name"] for m in tree["models"]] == ["smollm2", "gemma"]
    assert main(["--config", "configs/smoke.toml", "--as-configured", "--run-dir", str(tmp_path)]) == 2
    assert f"--run-dir {tmp_path}: already exists" in capsys.readouterr().err
