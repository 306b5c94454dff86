"""Two nodes that share nothing but a folder (tests/netns.py: each its own network namespace, address, /tmp and
/dev/shm, joined by a veth pair), each launcher started by torchrun as on a real cluster, keys on as beyond
loopback: a run across both trains to the end with nothing lost, and the loss of node 1 ends it in one line
naming the node, with no process left on either side. No loopback or shared-memory shortcut can hide a
cross-node bug here."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from enginerun import ROOT, Run, is_alive
from netns import two_machines, why_not
from raycluster import ray_cluster, raylet_of
from raycluster import why_not as ray_why_not
from test_engine_cluster import _killed

from engine.cluster.node import KEY_NAME, KEYS
from engine.record.rundir import free_port
from exchange.security import make_keys

# One after the other on one xdist worker: two Ray clusters at once would find (and kill) each other's processes.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("namespaces"),
              pytest.mark.skipif(why_not() is not None, reason=f"no namespaces: {why_not()}")]


@pytest.fixture
def shared(engine_cache):
    """The one folder both machines see (outside /tmp, which each has its own of): the run, the cache, the keys."""
    folder = Path("/var/tmp") / f"mrl-namespaces-{uuid.uuid4().hex[:8]}"
    shutil.copytree(engine_cache, folder / "cache")
    make_keys(folder / "keys", KEY_NAME)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _nodes(shared: Path, machines, *sets: str, resume: bool = False) -> tuple[Run, Run]:
    """Node 0's launcher and node 1's, each by torchrun on its machine: ``run`` (or ``resume`` of the run)."""
    port, env = free_port(), {KEYS: str(shared / "keys")}
    (on0, addr0), (on1, _) = machines
    cache = None if resume else shared / "cache"  # a resume takes everything from the run directory
    node1 = Run(shared / ("run" if resume else "unused"), cache, *sets, config="configs/pool.toml",
                node=(2, 1, port), env=env, machine=(on1, addr0))
    node0 = Run(shared / "run", cache, *sets, config="configs/pool.toml", node=(2, 0, port), env=env,
                machine=(on0, addr0))
    return node0, node1


def test_namespace_nodes_stop_on_ctrl_c_and_resume_to_the_end_over_the_veth_with_keys(shared):
    """Ctrl-C on node 0 (torchrun passes it on) stops both nodes with checkpoints; ``launch.py resume`` started by
    torchrun on both machines, as ``run`` was, trains to the end with nothing lost."""
    with two_machines() as machines:
        node0, node1 = _nodes(shared, machines, "pool.workers=4", "train.steps=10", "run.max_minutes=4")
        node0.wait_steps(2)
        node0.signal(signal.SIGINT)  # a terminal's Ctrl-C reaches torchrun, which passes it to the launcher
        assert node0.finish(timeout=300) != 0, node0.out[-3000:]
        node1.finish(timeout=300)  # its agent was told to stop (torchrun's own exit barrier may then fail: its code)
        assert "[cluster] 2 nodes" in node0.out and "[node1] serving the run" in node1.out
        marker = (shared / "run" / "INTERRUPTED").read_text()
        assert re.search(r"checkpoints and final evaluations: gpt2 at step \d+, llama at step \d+$", marker), marker
        assert node0.leftover() == [] and node1.leftover() == []
        resumed = _nodes(shared, machines, "train.steps=10", resume=True)
        assert [r.finish() for r in resumed] == [0, 0], resumed[0].out[-3000:] + resumed[1].out[-3000:]
    assert "tcp://10.77.0.1:" in (shared / "run" / "endpoints.json").read_text()  # node 0 listens on its veth
    assert "refused a client" not in node0.out + resumed[0].out
    result = resumed[0].result()
    assert result["steps"] == {"gpt2": 10, "llama": 10} and result["respawned"] == []
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert any(r.get("event") == "resumed" for r in resumed[0].records())
    assert resumed[0].leftover() == [] and resumed[1].leftover() == []


def test_the_loss_of_a_namespace_node_ends_the_run_in_one_line_naming_it(shared):
    with two_machines() as machines:
        node0, node1 = _nodes(shared, machines, "pool.workers=4", "train.steps=200", "run.max_minutes=4",
                              "timeouts.node_silent_s=10")
        node0.wait_steps(2)
        _killed(node1)
        assert node0.finish(timeout=300) != 0, node0.out[-3000:]
    assert "node 1 (10.77.0.2) said nothing for 10s" in node0.out, node0.out[-3000:]
    assert (shared / "run" / "FAILED").exists()
    assert node0.leftover() == [] and node1.leftover() == []


def _on_ray(on0, address: str, shared: Path, *args: str) -> subprocess.Popen:
    """``launch.py ... --ray ADDRESS`` started on machine 0, as a user on the head node types it."""
    return subprocess.Popen([*on0, sys.executable, str(ROOT / "launch.py"), *args, "--ray", address],
                            cwd=ROOT, env={**os.environ, KEYS: str(shared / "keys")}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


class _Driver:
    """A driver's output read by a thread as it comes: a wait polls the run itself and keeps its deadline even
    while the driver prints nothing (a blocking read of its pipe would wait past any deadline)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def until(self, done, timeout_s: float, what: str) -> None:
        deadline = time.time() + timeout_s
        while not done():
            if self.proc.poll() is not None:
                self.reader.join(10)
                raise AssertionError(f"the driver ended before {what}:\n" + "".join(self.lines[-60:]))
            assert time.time() < deadline, f"no {what} within {timeout_s:.0f} s:\n" + "".join(self.lines[-60:])
            time.sleep(0.5)

    def finish(self, timeout_s: float) -> str:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver did not end within {timeout_s:.0f} s:\n"
                                 + "".join(self.lines[-60:])) from None
        self.reader.join(10)
        return "".join(self.lines)


def _ray_run(on0, address: str, shared: Path, run_dir: Path, *sets: str) -> subprocess.Popen:
    return _on_ray(on0, address, shared, "run", "--config", str(ROOT / "configs/pool.toml"), "--run-dir", str(run_dir),
                   "--set", f"run.cache_dir='{shared / 'cache'}'", "--set", "run.report=false", "--set",
                   "pool.workers=4", "--set", "run.max_minutes=4", "--set", "train.steps=300", *sets)


def _steps_seen(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"event": "step"') if metrics.exists() else 0


@pytest.mark.skipif(ray_why_not() is not None, reason=f"no Ray: {ray_why_not()}")
def test_ray_places_a_launcher_a_node_stops_on_ctrl_c_resumes_and_a_lost_node_ends_a_run_in_one_line(shared):
    """One two-node Ray cluster: a run stopped by Ctrl-C at the driver and resumed to the end with nothing lost;
    then a second run whose other node's raylet is killed: one line naming the node, nothing left on either side."""
    before = {p.pid for p in psutil.process_iter()}
    with two_machines() as machines, ray_cluster(machines) as address:
        (on0, addr0), (_, addr1) = machines
        run = shared / "run"
        driver = _Driver(_ray_run(on0, address, shared, run))
        driver.until(lambda: _steps_seen(run) >= 2, 600, "two steps")
        os.killpg(driver.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C, to the driver: passed on to node 0's launcher
        out = driver.finish(300)
        assert driver.proc.returncode == 130, out[-3000:]
        assert f"[ray] 2 launchers placed, one a node; node 0 at {addr0} coordinates" in out  # the driver's node
        assert "Traceback" not in out, out[-3000:]
        assert "stopped by SIGINT" in (run / "INTERRUPTED").read_text()
        steps = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
                    if '"event": "step"' in line)
        again = _Driver(_on_ray(on0, address, shared, "resume", str(run), "--set", f"train.steps={steps + 2}"))
        out = again.finish(600)
        assert again.proc.returncode == 0, out[-3000:]
        assert "[node1] serving the run" in out  # node 1's launcher, placed by Ray on machine 1
        result = json.loads((run / "run_result.json").read_text())
        assert result["steps"] == {"gpt2": steps + 2, "llama": steps + 2}, out[-3000:]
        assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]

        lost = shared / "lost"
        driver = _Driver(_ray_run(on0, address, shared, lost, "--set", "timeouts.node_silent_s=10"))
        driver.until(lambda: _steps_seen(lost) >= 2, 600, "two steps")
        raylet_of(addr1).kill()  # the other node is lost: its raylet, and with it its actor and its launcher
        out = driver.finish(300)
        assert driver.proc.returncode != 0, out[-3000:]
        assert f"node 1 ({addr1}) said nothing for 10s" in out, out[-3000:]
        assert (lost / "FAILED").exists()
    time.sleep(1)
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before and str(shared) in
            " ".join(p.info["cmdline"] or []) and is_alive(p.pid)]  # this test's, on either node
    assert left == [], [p.info["cmdline"] for p in left]
