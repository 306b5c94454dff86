"""Several machines: torchrun starts one launcher per node, and node 0's runs the job.

    torchrun --nnodes N --nproc-per-node 1 --node-rank R --rdzv-endpoint HOST0:PORT launch.py run --config F

Node 0's launcher is the coordinator (``engine.coordinator``): warm starts, the exchange, the
weight hub, MWRA. Every other node's launcher is a node agent (``engine.cluster.agent``):
it spawns and stops the workers the coordinator places on its node and keeps its node's weight
channels fresh. torch.distributed (the launchers' own gloo group, formed from torchrun's
environment) is used once, to hand every node the plan: where node 0 listens. The rest is the
same ZeroMQ plane and exchange as on one machine, over tcp on node 0's address.

Workers are split in contiguous blocks: with W workers on N nodes node r holds
``w[r*W//N .. (r+1)*W//N - 1]``, its GPUs 0, 1, ... in that order. The run directory and the
cache of warm starts must be on a filesystem every node sees (checkpoints and the experience
log are read by whichever node leads a model next); a node that does not see them says so
and the run stops.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from pathlib import Path

import msgspec

from exchange.security import ClientKeys, CurveServer

HEARTBEAT_S = 2.0  # both sides say they are alive this often; one silent for timeouts.node_silent_s is gone
NODE_WAIT_S = 300.0  # how long the launchers wait for each other at the start (node 0 loads its config first)
INSECURE = "MUTUAL_RL_CLUSTER_INSECURE"  # "1": the nodes' network is private (plain tcp between them is accepted)
KEYS = "MUTUAL_RL_CLUSTER_KEYS"  # a directory holding cluster.key and cluster.key_secret: CurveZMQ between nodes
KEY_NAME = "cluster"  # python launch.py keys DIR --name cluster
MARKER = ".cluster-run"  # written by node 0 in the run dir: a node that cannot read it does not share the filesystem


class ClusterError(ValueError):
    """The launch environment cannot make a cluster; the message says what to change."""


@dataclass(frozen=True)
class Node:
    rank: int  # 0: the coordinator's node
    nodes: int
    master_addr: str  # node 0's address, as torchrun's rendezvous gave it
    keys: str = ""  # KEYS: every ZeroMQ socket between the nodes is CurveZMQ with this key pair

    @property
    def loopback(self) -> bool:
        return self.master_addr in ("127.0.0.1", "localhost", "::1")


class ClusterPlan(msgspec.Struct, frozen=True):
    """What node 0 tells every other node before anything else: where it listens, or why it will not run."""

    plane: str = ""  # the coordinator's plane (tcp)
    weights_hub: str = ""  # where node agents' relays ask for new weights (engine.weights.relay)
    run_dir: str = ""
    run_id: str = ""
    marker: str = ""  # the content of run_dir/MARKER
    keys: str = ""  # node 0's KEYS (every node reads the pair there: a shared filesystem, or the same path)
    silent_s: float = 30.0  # node 0's timeouts.node_silent_s: a node agent whose coordinator is silent this long stops
    error: str = ""  # node 0 could not start the run (a bad config): every node says it and exits 2


def from_env(environ=os.environ) -> Node | None:
    """The node this launcher runs on when torchrun started it on several nodes; None on one machine."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if int(environ.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise ClusterError(f"torchrun started {environ['LOCAL_WORLD_SIZE']} launchers on this node: run one per "
                           "node (--nproc-per-node 1); the launcher places the node's workers itself")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise ClusterError(f"WORLD_SIZE={environ['WORLD_SIZE']} but {', '.join(missing)} not set: start every node "
                           "with torchrun (--nnodes N --nproc-per-node 1 --node-rank R --rdzv-endpoint HOST:PORT)")
    keys = environ.get(KEYS, "")
    for name in (f"{KEY_NAME}.key", f"{KEY_NAME}.key_secret") if keys else ():
        if not (Path(keys) / name).is_file():
            raise ClusterError(f"{KEYS}={keys}: no {name} there (make the pair with "
                               f"`python launch.py keys {keys} --name {KEY_NAME}`)")
    node = Node(rank=int(environ["RANK"]), nodes=int(environ["WORLD_SIZE"]), master_addr=environ["MASTER_ADDR"],
                keys=keys)
    if not node.loopback and not keys and environ.get(INSECURE) != "1":
        raise ClusterError(f"node 0's address {node.master_addr} is not loopback: set {KEYS}=DIR on every node "
                           f"(CurveZMQ on the engine's sockets; `python launch.py keys DIR --name {KEY_NAME}`), or "
                           f"{INSECURE}=1 if the network between them is private")
    if not node.loopback and "GLOO_SOCKET_IFNAME" not in environ and (device := interface_toward(node.master_addr)):
        # gloo otherwise takes the address this machine's name resolves to, which /etc/hosts often maps to
        # 127.0.x.1: the other nodes would then dial their own loopback and wait until the time-out
        environ["GLOO_SOCKET_IFNAME"] = device
    return node


def interface_toward(host: str) -> str | None:
    """The name of this machine's network interface that reaches ``host`` (None: not found)."""
    import psutil

    mine = address_toward(host)
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] == mine for a in addrs)), None)


def client_keys(keys: str) -> ClientKeys | None:
    """A node's keys as a CurveZMQ client of node 0's sockets (every node holds the same pair); None: plain tcp."""
    return ClientKeys(f"{keys}/{KEY_NAME}.key_secret", f"{keys}/{KEY_NAME}.key") if keys else None


def curve_server(keys: str) -> CurveServer | None:
    """Node 0's side: its sockets are CurveZMQ servers admitting the cluster's key; started (stop it at the end)."""
    if not keys:
        return None
    import zmq.asyncio

    server = CurveServer(zmq.Context.shadow(zmq.asyncio.Context.instance()), f"{keys}/{KEY_NAME}.key_secret", keys)
    server.start()  # the authenticator of the process's ZeroMQ context: before any socket binds
    return server


def share_plan(node: Node, plan: ClusterPlan | None, timeout_s: float) -> ClusterPlan:
    """Node 0 gives ``plan``, every node returns it (the launchers' gloo group, formed and left here)."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        box = [msgspec.msgpack.encode(plan) if node.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        dist.destroy_process_group()
    except Exception as exc:  # torch raises several unrelated types for a node that never came
        raise ClusterError(f"the {node.nodes} launchers did not meet at {node.master_addr} within "
                           f"{timeout_s:.0f}s ({type(exc).__name__}): start one on every node") from None
    return msgspec.msgpack.decode(box[0], type=ClusterPlan)


def address_toward(host: str) -> str:
    """This machine's address on the interface that reaches ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def node_of(worker_index: int, workers: int, nodes: int) -> tuple[int, int]:
    """(node, device index on that node) of worker ``worker_index``: contiguous blocks."""
    node = next(r for r in range(nodes) if worker_index < (r + 1) * workers // nodes)
    return node, worker_index - node * workers // nodes


def tcp(host: str) -> str:
    """A fresh tcp endpoint on ``host`` (a port free now)."""
    from engine.record.rundir import free_port

    return f"tcp://{'[' + host + ']' if ':' in host else host}:{free_port(host)}"
