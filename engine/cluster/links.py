"""The coordinator's side of a cluster: the other nodes' launchers, and the actors they run for it.

A worker on node r > 0 is an ``Actor`` like any other, whose process is a ``RemoteProcess``:
its node agent (``engine.cluster.agent``) spawned it, says when it exits, and signals it
when asked, so the failure policy, the halt and the audit treat it as they treat a local one.
Both sides beat every ``HEARTBEAT_S``; a node silent for ``timeouts.node_silent_s`` ends the run (its workers
went with it, and no node is started again in a run).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import threading
import time

from engine.runtime import actors
from engine.cluster.node import (HEARTBEAT_S, MARKER, NODE_WAIT_S, ClusterError, ClusterPlan, Node,
                                    client_keys, share_plan)
from engine.runtime.plane import (ActorExited, CoordinatorPlane, NodeBeat, NodeDone, NodeHello, NodeStop, Signal,
                                  Spawn)


class RemoteProcess:
    """What the coordinator uses of a ``multiprocessing.Process``, for a process on another node."""

    def __init__(self, link: NodeLink, node: int, name: str):
        self.link, self.node, self.name = link, node, name
        self.pid = 0  # the process's own (on its node), once it says hello
        self.exitcode: int | None = None
        self._exited = threading.Event()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def exited(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
            self._exited.set()

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def kill(self) -> None:
        self.link.signal(self.node, self.name, signal.SIGKILL)


class NodeLink:
    """Nodes 1..N-1 as the coordinator sees them: addresses, channel roots, remote actors, heartbeats."""

    def __init__(self, node: Node, plane: CoordinatorPlane, silent_s: float):
        self.node, self.plane, self.silent_s = node, plane, silent_s
        self.hello: dict[int, NodeHello] = {}
        self.seen: dict[int, float] = {}
        self.remote: dict[str, RemoteProcess] = {}
        self.done: dict[int, NodeDone] = {}
        self.changed = asyncio.Event()

    @property
    def others(self) -> list[int]:
        return list(range(1, self.node.nodes))

    async def gather(self, plan: ClusterPlan, timeout_s: float) -> None:
        """Hand every node the plan and wait ``timeout_s`` for each to connect (``NodeHello``); ClusterError if
        one does not."""
        await asyncio.to_thread(share_plan, self.node, plan, NODE_WAIT_S)
        deadline = time.time() + timeout_s
        while True:
            if refused := [h for h in self.hello.values() if h.problem]:
                raise ClusterError(f"node {refused[0].node}: {refused[0].problem}")
            if set(self.hello) == set(self.others):
                return
            if time.time() > deadline:
                missing = sorted(set(self.others) - set(self.hello))
                raise ClusterError(f"node(s) {missing} took the plan but never connected to {plan.plane} "
                                   f"within {timeout_s:.0f}s (a firewall between the nodes?)")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 1.0)
            except TimeoutError:
                pass

    def take(self, sender: str, msg) -> bool:
        """Handle a node's message (True), or leave it to the coordinator (False)."""
        if isinstance(msg, NodeHello):
            self.hello[msg.node] = msg
        elif isinstance(msg, ActorExited):
            if msg.name in self.remote:
                self.remote[msg.name].exited(msg.exitcode)
        elif isinstance(msg, NodeDone):
            self.done[msg.node] = msg
        elif not isinstance(msg, NodeBeat):
            return False
        if sender.startswith("node"):
            self.seen[int(sender[4:])] = time.time()
        self.changed.set()
        return True

    def address(self, node: int) -> str:
        return self.node.master_addr if node == 0 else self.hello[node].address

    def weights_root(self, node: int) -> str:
        return self.hello[node].weights_root

    def spawn(self, node: int, name: str, entry: str, payload: bytes, threads: int) -> actors.Actor:
        proc = self.remote[name] = RemoteProcess(self, node, name)
        asyncio.get_running_loop().create_task(self.plane.send(f"node{node}", Spawn(name, entry, payload, threads)))
        return actors.Actor(name=name, process=proc)

    def signal(self, node: int, name: str, signum: int) -> None:
        asyncio.get_running_loop().create_task(self.plane.send(f"node{node}", Signal(name, int(signum))))

    def said_hello(self, name: str, pid: int) -> bool:
        """A worker said hello: True if it runs on another node (its pid is known now)."""
        if name in self.remote:
            self.remote[name].pid = pid
        return name in self.remote

    async def beat(self) -> str:
        """Beat until a node falls silent; returns why the run must end."""
        while True:
            for r in self.others:
                await self.plane.send(f"node{r}", NodeBeat())
            if silent := self.silent():
                return (f"node {silent[0]} ({self.address(silent[0])}) said nothing for {self.silent_s:g}s: its "
                        "workers are lost with it; a run does not continue without one of its nodes")
            await asyncio.sleep(HEARTBEAT_S)

    def silent(self) -> list[int]:
        """The nodes not heard from for ``silent_s``: gone, with every actor they ran for us."""
        now = time.time()
        return [r for r in self.others if now - self.seen.get(r, now) > self.silent_s]

    async def stop(self, grace_s: float) -> None:
        """Every node stops its actors and answers; the plane is read here (the coordinator's listener is gone).
        A silent node is not waited for: it cannot answer, and its actors are counted killed."""
        answering = set(self.others) - set(self.silent())
        for r in sorted(answering):
            await self.plane.send(f"node{r}", NodeStop(grace_s))
        deadline = time.time() + grace_s + 10.0
        while not answering <= set(self.done) and time.time() < deadline:
            try:
                sender, msg = await asyncio.wait_for(self.plane.recv(), max(0.1, deadline - time.time()))
            except TimeoutError:
                break
            self.take(sender, msg)
        for proc in self.remote.values():
            codes = self.done.get(proc.node)
            proc.exited(codes.exitcodes.get(proc.name, -signal.SIGKILL) if codes else -signal.SIGKILL)


async def start_cluster(c) -> None:
    """Node 0's coordinator ``c`` meets the other nodes: the weight hub and node 0's own relay start, every node
    gets the plan and connects (its tasks join ``c.tasks``; a node that falls silent makes the run fail)."""
    from engine.weights.relay import Relay, WeightsHub

    c.nodes = NodeLink(c.node, c.plane, c.cfg.timeouts.node_silent_s)
    c.weights_hub = WeightsHub(c.host, c.curve)
    c.relay = Relay(c.weights_hub.outbound, c.weights_root, client_keys(c.node.keys))  # node 0's own channels

    async def watch_nodes() -> None:
        c.failures.fatal = await c.nodes.beat()
        c.changed.set()

    for coro in (c.weights_hub.serve(), c.relay.serve(), watch_nodes()):
        c.tasks.append(asyncio.create_task(coro))
        c.tasks[-1].add_done_callback(c._task_ended)
    marker = secrets.token_hex(8)
    (c.run_dir / MARKER).write_text(marker)
    await c.nodes.gather(ClusterPlan(c.plane.endpoint, c.weights_hub.outbound, str(c.run_dir.resolve()),
                                     c.run_dir.name, marker, keys=c.node.keys, silent_s=c.cfg.timeouts.node_silent_s),
                         c.cfg.timeouts.worker_start_s)
    c.say(f"[cluster] {c.node.nodes} nodes: " + ", ".join(f"node {r} at {c.nodes.address(r)}"
                                                          for r in range(c.node.nodes)))
