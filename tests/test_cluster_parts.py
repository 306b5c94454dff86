"""The cluster's parts without a run: torchrun's environment read, workers placed on nodes, weights relayed through
the hub to every node's channels (real ZeroMQ sockets, real shared-memory channels), and a node 0 that refuses its
config tells node 1 at once."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from engine.cluster.node import (KEY_NAME, ClusterError, client_keys, curve_server, from_env, interface_toward,
                                    node_of)
from engine.record.rundir import free_port
from engine.weights.channel import WeightReader
from engine.weights.relay import Relay, RelayWriter, WeightsHub
from exchange.security import make_keys

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_one_machine_is_no_cluster_and_a_cluster_needs_one_launcher_per_node():
    assert from_env({}) is None and from_env({"WORLD_SIZE": "1"}) is None
    env = {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ClusterError, match="MUTUAL_RL_CLUSTER_KEYS=DIR"):  # plain tcp beyond loopback: only if said
        from_env(env)
    with pytest.raises(ClusterError, match="no cluster.key there"):
        from_env({**env, "MUTUAL_RL_CLUSTER_KEYS": "/nonexistent"})
    given = {**env, "MUTUAL_RL_CLUSTER_INSECURE": "1"}
    node = from_env(given)
    assert (node.rank, node.nodes, node.master_addr, node.loopback) == (2, 3, "10.0.0.1", False)
    # gloo speaks on the interface that reaches node 0, not the one this machine's name resolves to (often loopback)
    assert given["GLOO_SOCKET_IFNAME"] == interface_toward("10.0.0.1") != "lo"
    kept = {**env, "MUTUAL_RL_CLUSTER_INSECURE": "1", "GLOO_SOCKET_IFNAME": "ib0"}
    from_env(kept)
    assert kept["GLOO_SOCKET_IFNAME"] == "ib0"  # the user's choice stands
    with pytest.raises(ClusterError, match="--nproc-per-node 1"):
        from_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ClusterError, match="MASTER_ADDR"):
        from_env({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"})


def test_workers_fill_nodes_in_contiguous_blocks():
    assert [node_of(i, 6, 2) for i in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [node_of(i, 5, 2)[0] for i in range(5)] == [0, 0, 1, 1, 1]
    assert [node_of(i, 4, 1) for i in range(4)] == [(0, i) for i in range(4)]


@pytest.mark.parametrize("keys", [False, True], ids=["plain", "curve"])
def test_every_node_gets_the_newest_weights_bit_for_bit_and_never_an_older_one(tmp_path, keys):
    if keys:
        make_keys(tmp_path / "keys", KEY_NAME)
    keys_dir = str(tmp_path / "keys") if keys else ""

    async def main():
        server = curve_server(keys_dir)
        hub = WeightsHub("127.0.0.1", server)
        relays = [Relay(hub.outbound, tmp_path / f"node{r}", client_keys(keys_dir)) for r in range(2)]
        strangers = []
        if keys:  # a pair the cluster does not know: the hub refuses it
            make_keys(tmp_path / "stranger", KEY_NAME)
            strangers = [Relay(hub.outbound, tmp_path / "stranger-node", client_keys(str(tmp_path / "stranger")))]
        tasks = [asyncio.create_task(t.serve()) for t in (hub, *relays, *strangers)]
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        writer = RelayWriter(hub.inbound, "m", model, client_keys(keys_dir))
        seen: list[list[int]] = [[], []]
        for version in range(1, 21):
            with torch.no_grad():
                model.weight.add_(1.0)
            await asyncio.to_thread(writer.publish, version)
            for r, relay in enumerate(relays):
                if (relay.root / "m").is_dir():
                    seen[r].append(WeightReader(relay.root / "m", torch.nn.Linear(16, 8)).newest())
        for _ in range(500):  # until both relays hold version 20 (each waits for it, not for time)
            if all((r.root / "m").is_dir() and WeightReader(r.root / "m", torch.nn.Linear(16, 8)).newest() == 20
                   for r in relays):
                break
            await asyncio.sleep(0.01)
        copies = []
        for relay in relays:
            twin = torch.nn.Linear(16, 8)
            reader = WeightReader(relay.root / "m", twin)
            assert reader.load() == 20
            copies.append(twin)
        assert not (tmp_path / "stranger-node").exists()  # by the time every node has version 20, none for it
        for t in tasks:
            t.cancel()
        writer.close()
        hub.close()
        if server is not None:
            server.stop()
        return model, copies, seen

    model, copies, seen = asyncio.run(main())
    for twin in copies:
        assert torch.equal(twin.weight, model.weight) and torch.equal(twin.bias, model.bias)
    for versions in seen:
        assert versions == sorted(versions)  # a node's head only moves forward


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_node_0_that_refuses_its_config_stops_node_1_at_once(tmp_path):
    port = free_port()

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", str(ROOT / "launch.py"), "run", "--config",
             str(ROOT / "configs/pool.toml"), "--run-dir", str(tmp_path / f"run{rank}"), "--set", "pool.workers=3"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    node1, node0 = node(1), node(0)
    out0, out1 = node0.communicate(timeout=300)[0], node1.communicate(timeout=300)[0]
    assert node0.returncode != 0 and out0.splitlines()[0].startswith("error: --set pool.workers=3"), out0
    assert node1.returncode != 0, out1
    assert "[node1] node 0 did not start the run: its config or run directory was refused" in out1, out1
    assert f'File "{ROOT}' not in out0 + out1  # torchrun prints its own traceback for a child's exit 2, none of ours
