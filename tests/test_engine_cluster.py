"""Two nodes on loopback, each launcher started by torchrun as on a real cluster: node 0 coordinates, node 1's
agent runs its workers; they train the same models together while MWRA runs and a scripted move takes a node-0
worker into a learner group led on node 1. Weights reach each node through the hub, bit for bit; with the cluster's
keys every ZeroMQ socket between the nodes is CurveZMQ. A coordinator that dies ends the run on every node with one
line and no process left (a node that dies, and Ctrl-C and resume: tests/test_cluster_namespaces.py, across two
network namespaces)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest
from enginerun import ROOT, Run
from poolsetup import script, static_pool
from test_engine_pool import _bits_exact

from engine.cluster.node import KEY_NAME, KEYS
from exchange.security import make_keys
from engine.record.rundir import free_port
from exchange.log import ExperienceLogReader

pytestmark = pytest.mark.slow
POOL = "configs/pool.toml"
SILENT = "timeouts.node_silent_s=10"  # the dying-node tests wait this silence (the default 30 s, shortened as a user may)
CONTROLLER = ("pool.controller={decision_interval_s = 2.0, cooldown_s = 4.0, min_dwell_s = 15.0, "
              "ewma_halflife_s = 3.0, min_busy_s = 0.5}")


def _nodes(tmp_path, cache, *sets: str, keys: bool = False) -> tuple[Run, Run]:
    port = free_port()
    env = {}
    if keys:  # CurveZMQ on every socket between the nodes, as beyond loopback
        make_keys(tmp_path / "keys", KEY_NAME)
        env = {KEYS: str(tmp_path / "keys")}
    node1 = Run(tmp_path / "unused", cache, *sets, config=POOL, node=(2, 1, port), env=env)  # takes node 0's run dir
    node0 = Run(tmp_path / "run", cache, *sets, config=POOL, node=(2, 0, port), env=env)
    return node0, node1


def test_two_nodes_on_loopback_train_together_under_mwra(tmp_path, engine_cache):
    """Weights on the channel, relayed to node 1 by the hub (the cluster's own path). Pair groups between the
    nodes are the same gloo pairs test_weight_broadcast.py forms on loopback, and the replicated runs over
    ``pool.weights=broadcast`` (test_engine_pool.py, test_engine_run.py) form them between processes."""
    # workers w0-w2 on node 0, w3-w5 on node 1 (contiguous blocks); MWRA's first split leads both groups on node 1
    # (w4: gpt2, w5: llama), and the script moves w2 of node 0 into gpt2's (as MWRA itself would: gpt2 learns slowest)
    node0, node1 = _nodes(tmp_path, engine_cache, "pool.workers=6", "train.steps=14", "run.max_minutes=4",
                          "pool.weights=channel",
                          "pool.costs.1.from_s=20", CONTROLLER, script(("gpt2", 2, "w2", "learner", "gpt2")), keys=True)
    node0.wait_steps(1)  # a person taps the stream with the command node 0 printed (the cluster's keys in it) ...
    tap = node0.out.split("watch the experience stream: python ")[1].splitlines()[0].split()
    shown = subprocess.run([sys.executable, *tap, "--count", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) == 3, shown.stdout + shown.stderr
    keyless = [a for i, a in enumerate(tap) if not a.startswith("--curve") and not tap[i - 1].startswith("--curve")]
    refused = subprocess.run([sys.executable, *keyless, "--count", "1", "--timeout", "3"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and refused.stdout == ""  # ... and without them gets nothing
    assert node0.finish() == 0, node0.out[-3000:]
    assert node1.finish() == 0, node1.out[-3000:]
    assert "[cluster] 2 nodes" in node0.out and "[node1] serving the run" in node1.out
    assert "refused a client" not in node0.out  # every socket between the nodes spoke CurveZMQ with the pair
    assert not (tmp_path / "unused").exists()  # node 1 writes into node 0's run directory only
    result, records = node0.result(), node0.records()
    assert result["steps"] == {"gpt2": 14, "llama": 14}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert [r for r in records if r.get("kind") == "mwra_decision"], "MWRA never decided"
    # w2 joins gpt2's group by the script, or by MWRA first where this machine is slow enough (the script is a
    # no-op then): either way a group spans both nodes
    scripted = [r["changes"] for r in records if r.get("event") == "assign" and r["reason"].startswith("scripted")]
    assert scripted in ([{"w2": ["learner", "gpt2"]}], []), scripted
    assert any(r.get("event") == "assign" and r["changes"].get("w2") == ["learner", "gpt2"] for r in records)
    for f in result["formations"]:  # every rank of every formation, on either node, holds rank 0's exact state
        assert len(set(f["digests"].values())) == 1, f
    node_of = {w: 0 if w in ("w0", "w1", "w2") else 1 for f in result["formations"] for w in f["digests"]}
    assert any({node_of[w] for w in f["digests"]} == {0, 1} for f in result["formations"]), result["formations"]
    # each node generated with versions its learners published (on the other node or its own), only through the hub
    # (a leader writes no channel itself in a cluster), and a generator's first weights match the learner's bit for bit
    made_by = collections.defaultdict(set)
    for exp in ExperienceLogReader(node0.run_dir / "experience_log"):
        made_by[exp.experience_id.rsplit("/", 1)[1]].add(exp.weight_version)
    for node, workers in {0: ("w0", "w1", "w2"), 1: ("w3", "w4", "w5")}.items():
        assert max(v for w in workers for v in made_by[w] | {0}) > 0, (node, dict(made_by))
    for w in made_by:
        for m in ("gpt2", "llama"):
            _bits_exact(result, records, w, m)
    assert node0.leftover() == [] and node1.leftover() == []


def _killed(run: Run) -> None:
    """The whole machine of ``run`` is gone: torchrun, the launcher, its fork server and every worker, at once
    (torchrun starts the launcher in a session of its own: a process group is not the machine)."""
    procs = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True)]
    run.seen.update(p.pid for p in procs)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    run.proc.wait(30)


def test_a_node_whose_coordinator_dies_stops_its_workers_and_exits(tmp_path, engine_cache):
    node0, node1 = _nodes(tmp_path, engine_cache, "pool.workers=4", "train.steps=200", "run.max_minutes=4", SILENT)
    node0.wait_steps(2)
    _killed(node0)
    assert node1.finish(timeout=300) != 0, node1.out[-3000:]
    assert "the coordinator" in node1.out and "said nothing for 10s: stopping this node's workers" \
        in node1.out, node1.out[-3000:]
    assert node1.leftover() == []


def test_a_dead_worker_on_node_1_is_replaced_on_node_1(tmp_path, engine_cache):
    # static split in pool-key order: w0, w1 generate gpt2 (node 0), w2, w3 llama, w4, w5 learn (node 1)
    node0, node1 = _nodes(tmp_path, engine_cache, *static_pool(6, 10, (2, 2, 1, 1)))
    node0.wait_steps(2, "llama")
    os.kill(node0.pids()["w3"], signal.SIGKILL)  # its pid on node 1 (this machine, on loopback)
    node0.wait_for(lambda: node0.pids().get("w6", 0) > 0, "w6's hello")  # a remote pid is known at its hello
    on_node1 = {p.pid for p in psutil.Process(node1.proc.pid).children(recursive=True)}
    assert node0.pids()["w6"] in on_node1  # the replacement runs where the dead worker ran
    assert node0.finish() == 0, node0.out[-3000:]
    assert node1.finish() == 0, node1.out[-3000:]
    assert "[run] w3 (generator of llama) exited with code -9" in node0.out and "w6 takes its place" in node0.out
    result = node0.result()
    assert result["respawned"] == ["w6"] and result["steps"] == {"gpt2": 10, "llama": 10}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert node0.leftover() == [] and node1.leftover() == []
