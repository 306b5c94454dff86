"""A node agent: the launcher on node r > 0 of a cluster (``engine.cluster.node``).

It runs no part of the job itself. It connects to the coordinator's plane as ``node<r>``,
spawns the actors the coordinator places here (``Spawn``), says when one exits
(``ActorExited``), signals one when asked, keeps this node's weight channels fresh (a
``Relay`` from node 0's hub), and stops everything on ``NodeStop``. If the coordinator falls
silent for ``timeouts.node_silent_s`` (node 0's, in the plan) it stops its actors and exits 1:
nothing outlives the run on any node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from engine.runtime import actors
from engine.cluster.node import HEARTBEAT_S, MARKER, ClusterPlan, Node, address_toward, client_keys
from engine.runtime.plane import ActorExited, NodeBeat, NodeDone, NodeHello, NodeStop, Signal, Spawn, ToNode, WorkerPlane
from engine.weights.places import channel_root
from engine.weights.relay import Relay


def sees_run_dir(plan: ClusterPlan) -> str | None:
    """Why this node cannot serve the run (it does not see node 0's run directory), or None."""
    try:
        if (Path(plan.run_dir) / MARKER).read_text() == plan.marker:
            return None
    except OSError:
        pass
    return (f"this node does not see node 0's run directory {plan.run_dir}: put run directories (--run-dir) and "
            "the cache (MUTUAL_RL_CACHE) on a filesystem every node mounts")


class NodeAgent:
    def __init__(self, node: Node, plan: ClusterPlan):
        self.node, self.plan = node, plan
        self.name = f"node{node.rank}"
        self.local: dict[str, actors.Actor] = {}
        self.reported: set[str] = set()
        self.last_heard = time.time()

    def say(self, text: str) -> None:
        print(f"[{self.name}] {text}", file=sys.stderr, flush=True)

    def hello(self, root: str, problem: str = "") -> NodeHello:
        return NodeHello(self.node.rank, address_toward(self.node.master_addr), os.getpid(), root, problem)

    async def refuse(self, problem: str) -> int:
        """Tell the coordinator why this node cannot serve (the run stops with that line), then leave."""
        plane = WorkerPlane(self.plan.plane, self.name, reads=ToNode, curve=client_keys(self.plan.keys))
        await plane.send(self.hello("", problem))
        plane.close()
        return 2

    async def serve(self) -> int:
        if problem := sees_run_dir(self.plan):
            self.say(problem)
            return await self.refuse(problem)
        self.root = channel_root(f"{self.plan.run_id}-{self.name}-{os.getpid():x}")  # two runs' dirs may share a name
        self.plane = WorkerPlane(self.plan.plane, self.name, reads=ToNode, curve=client_keys(self.plan.keys))
        relay = Relay(self.plan.weights_hub, self.root, client_keys(self.plan.keys))
        tasks = [asyncio.create_task(relay.serve()), asyncio.create_task(self._beat())]
        try:
            await self.plane.send(self.hello(str(self.root)))
            return await self._obey()
        finally:
            for task in tasks:
                task.cancel()
            relay.close()
            self.plane.close()
            shutil.rmtree(self.root, ignore_errors=True)

    async def _obey(self) -> int:
        while True:
            try:
                msg = await asyncio.wait_for(self.plane.recv(), HEARTBEAT_S)
            except TimeoutError:
                msg = None
            if msg is not None:
                self.last_heard = time.time()
            if isinstance(msg, Spawn):
                self.local[msg.name] = actors.spawn(msg.name, msg.entry, msg.payload, msg.threads)
            elif isinstance(msg, Signal) and msg.name in self.local and self.local[msg.name].alive:
                os.kill(self.local[msg.name].process.pid, msg.signum)
            elif isinstance(msg, NodeStop):
                await asyncio.to_thread(actors.stop_all, list(self.local.values()), msg.grace_s)
                codes = {name: a.exitcode if a.exitcode is not None else -9 for name, a in self.local.items()}
                await self.plane.send(NodeDone(self.node.rank, codes))
                return 0
            if time.time() - self.last_heard > self.plan.silent_s:
                self.say(f"the coordinator ({self.plan.plane}) said nothing for {self.plan.silent_s:g}s: stopping this "
                         "node's workers")
                await asyncio.to_thread(actors.stop_all, list(self.local.values()), 0.0)
                return 1

    async def _beat(self) -> None:
        while True:
            await self.plane.send(NodeBeat())
            for name, actor in list(self.local.items()):  # a Spawn may add one while a send waits
                if not actor.alive and name not in self.reported:
                    self.reported.add(name)
                    await self.plane.send(ActorExited(self.node.rank, name, actor.exitcode))
            await asyncio.sleep(min(HEARTBEAT_S, 0.5))


def serve(node: Node, plan: ClusterPlan) -> int:
    """Node r's whole launcher run after the plan: its exit code."""
    import uvloop

    if plan.error:
        print(f"[node{node.rank}] node 0 did not start the run: {plan.error}", file=sys.stderr, flush=True)
        return 2
    print(f"[node{node.rank}] serving the run {plan.run_dir} of node 0 ({plan.plane})", flush=True)
    return uvloop.run(NodeAgent(node, plan).serve())
