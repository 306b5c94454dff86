"""Two nodes on loopback, each launcher started by torchrun as on a real cluster: node 0 coordinates, node 1's
agent runs its workers; they train the same models together while MWRA runs and a scripted move takes a node-1
worker into a learner group led on node 0. Weights reach each node through the hub, bit for bit."""

from __future__ import annotations

import collections

import pytest
from enginerun import Run
from poolsetup import script
from test_engine_pool import _bits_exact

from engine.runtime.rundir import free_port
from exchange.log import ExperienceLogReader

pytestmark = pytest.mark.slow
POOL = "configs/pool.toml"
CONTROLLER = ("pool.controller={decision_interval_s = 2.0, cooldown_s = 4.0, min_dwell_s = 15.0, "
              "ewma_halflife_s = 3.0, min_busy_s = 0.5}")


def _nodes(tmp_path, cache, *sets: str) -> tuple[Run, Run]:
    port = free_port()
    node1 = Run(tmp_path / "unused", cache, *sets, config=POOL, node=(2, 1, port))  # takes node 0's run dir
    node0 = Run(tmp_path / "run", cache, *sets, config=POOL, node=(2, 0, port))
    return node0, node1


def test_two_nodes_on_loopback_train_together_under_mwra(tmp_path, engine_cache):
    # workers w0-w2 on node 0, w3-w5 on node 1 (contiguous blocks); MWRA's first split leads both groups on node 1
    # (w4: gpt2, w5: llama), and the script moves w2 of node 0 into gpt2's (as MWRA itself would: gpt2 learns slowest)
    node0, node1 = _nodes(tmp_path, engine_cache, "pool.workers=6", "train.steps=14", "run.max_minutes=4",
                          "pool.costs.1.from_s=20", CONTROLLER, script(("gpt2", 2, "w2", "learner", "gpt2")))
    assert node0.finish() == 0, node0.out[-3000:]
    assert node1.finish() == 0, node1.out[-3000:]
    assert "[cluster] 2 nodes" in node0.out and "[node1] serving the run" in node1.out
    assert not (tmp_path / "unused").exists()  # node 1 writes into node 0's run directory only
    result, records = node0.result(), node0.records()
    assert result["steps"] == {"gpt2": 14, "llama": 14}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    assert [r for r in records if r.get("kind") == "mwra_decision"], "MWRA never decided"
    scripted = [r for r in records if r.get("event") == "assign" and r["reason"].startswith("scripted")]
    assert [r["changes"] for r in scripted] == [{"w2": ["learner", "gpt2"]}]
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
