"""``launch.py run --ray ADDRESS`` (and ``resume``): Ray places the launchers; the engine runs the rest.

One placement group with a bundle per node (``STRICT_SPREAD``: each bundle on its own node, holding the CPUs
and GPUs of that node's workers), and on each bundle one ``NodeLauncher`` actor that starts ``launch.py`` as
its child in the environment torchrun would give it (``WORLD_SIZE``, ``RANK`` = the bundle's index,
``MASTER_ADDR`` = bundle 0's node): node 0's launcher is the coordinator and every other node's a node agent,
exactly as under torchrun or Slurm. Nothing else goes through Ray: experience over ZeroMQ, weights over the
engine's channels and torch.distributed, the heartbeats, the failure policy and ``resume`` are the engine's own.
This process waits, passes a Ctrl-C on to node 0's launcher, and exits with its code. A launcher dies with its
actor (a node's raylet gone takes them both), and its workers follow it.
"""

from __future__ import annotations

import os
import signal
import sys

from mutual_rl.runs import LAUNCH

FORWARDED = ("MUTUAL_RL_CACHE", "MUTUAL_RL_CLUSTER_KEYS", "MUTUAL_RL_CLUSTER_INSECURE", "PYTHONPATH", "XDG_CACHE_HOME")


class RayPlacementError(RuntimeError):
    """Ray could not be reached or could not place the run; the message says what to change."""


def _launcher_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)  # wait() blocks one thread; signal() must still get through
    class NodeLauncher:
        def address(self) -> tuple[str, int]:
            import socket

            host = ray.util.get_node_ip_address()
            with socket.socket() as s:
                s.bind((host, 0))
                return host, s.getsockname()[1]

        def start(self, args: list[str], env: dict[str, str], cwd: str) -> int:
            import ctypes
            import subprocess

            def die_with_this_actor() -> None:  # PR_SET_PDEATHSIG: the raylet killing the actor kills its launcher
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)

            self.proc = subprocess.Popen(args, env={**os.environ, **env}, cwd=cwd, preexec_fn=die_with_this_actor)
            return self.proc.pid

        def wait(self) -> int:
            return self.proc.wait()

        def signal(self, sig: int) -> None:
            self.proc.send_signal(sig)

    return NodeLauncher


def run_on_ray(address: str, nodes: int, cfg, launch_args: list[str]) -> int:
    """The launchers of a run (``launch_args``: what follows ``launch.py``) on ``nodes`` Ray nodes; node 0's exit
    code. Ray that cannot be reached or cannot place the run is a RayPlacementError."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise RayPlacementError("--ray needs the ray package: pip install -c constraints.txt -e '.[ray]'") from None
    _reachable(address)
    try:
        ray.init(address=address, log_to_driver=True, logging_level="ERROR", configure_logging=False)
    except Exception as exc:  # ConnectionError and friends: no cluster there
        raise RayPlacementError(f"--ray {address}: no Ray cluster reached ({type(exc).__name__}: {exc})") from None
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        nodes = nodes or len(alive)
        if nodes > len(alive):
            raise RayPlacementError(f"--ray-nodes {nodes}: the Ray cluster at {address} has {len(alive)} live nodes")
        bundle = _bundle(cfg, nodes)
        group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD")
        ready, _ = ray.wait([group.ready()], timeout=120)
        if not ready:
            raise RayPlacementError(f"Ray could not reserve {nodes} nodes of {bundle} each within 120 s (each node "
                                    "needs them free: ray status shows what it has)")
        try:
            return _launch_and_wait(ray, group, PlacementGroupSchedulingStrategy, nodes, launch_args)
        finally:
            remove_placement_group(group)
    finally:
        ray.shutdown()


def _reachable(address: str, timeout_s: float = 10.0) -> None:
    """A host:port that answers (Ray itself retries an unreachable one for minutes); "auto" is Ray's to find."""
    import socket

    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or address, int(port or 6379)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise RayPlacementError(f"--ray {address}: no Ray cluster answers there ({exc}); start one with "
                                "`ray start --head`, or give its GCS address (host:port)") from None


def _bundle(cfg, nodes: int) -> dict[str, float]:
    """What one node's workers hold: a CPU a worker thread, and a GPU a worker on CUDA."""
    per_node = -(-cfg.pool.workers // nodes)
    bundle: dict[str, float] = {"CPU": float(per_node * cfg.pool.threads_per_worker)}
    if cfg.pool.device == "cuda":
        bundle["GPU"] = float(per_node)
    return bundle


def _driver_node_first(ray, group, nodes: int) -> list[int]:
    """The group's bundle indices, the one on the driver's own Ray node first: node 0 (the coordinator, which
    writes the run directory) then runs where the user typed the command, and the driver's node is never the
    one whose loss leaves the driver cut off from a coordinator that still runs."""
    from ray.util import placement_group_table

    here = ray.get_runtime_context().get_node_id()
    on = placement_group_table(group).get("bundles_to_node_id", {})
    return sorted(range(nodes), key=lambda i: on.get(i) != here)


def _in_time(ray, refs, what: str, timeout_s: float = 180.0):
    """``ray.get`` of a launcher's start-up, which Ray would otherwise wait on forever (an actor whose worker
    process never comes up)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RayPlacementError(f"{what} within {timeout_s:.0f} s of being placed (ray status, and the Ray logs "
                                "of the node, say why)") from None


def _launch_and_wait(ray, group, strategy, nodes: int, launch_args: list[str]) -> int:
    launcher = _launcher_class()
    actors = [launcher.options(scheduling_strategy=strategy(placement_group=group, placement_group_bundle_index=i),
                               name=None).remote() for i in _driver_node_first(ray, group, nodes)]
    host, port = _in_time(ray, actors[0].address.remote(), "node 0's launcher did not start")
    shared = {k: os.environ[k] for k in FORWARDED if k in os.environ}
    torchrun = {"WORLD_SIZE": str(nodes), "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    args = [sys.executable, "-u", str(LAUNCH), *launch_args]
    _in_time(ray, [a.start.remote(args, {**shared, **torchrun, "RANK": str(i), "LOCAL_RANK": "0"}, os.getcwd())
                   for i, a in enumerate(actors)], "the launchers did not all start")
    print(f"[ray] {nodes} launchers placed, one a node; node 0 at {host} coordinates", flush=True)
    previous = signal.signal(signal.SIGINT, lambda *_: actors[0].signal.remote(signal.SIGINT))
    try:
        try:
            code = ray.get(actors[0].wait.remote())
        except ray.exceptions.RayActorError:
            print(f"error: node 0's launcher was lost with its Ray node ({host}); the other nodes stop when they "
                  "stop hearing it", file=sys.stderr, flush=True)
            code = 1
        for i, actor in enumerate(actors[1:], start=1):
            try:
                ray.get(actor.wait.remote(), timeout=120)
            except ray.exceptions.RayActorError:
                pass  # its node is gone: node 0 has said so in its own line
            except ray.exceptions.GetTimeoutError:
                print(f"[ray] node {i}'s launcher did not end within 120 s of node 0's; it is stopped",
                      file=sys.stderr, flush=True)
                ray.kill(actor)
    finally:
        signal.signal(signal.SIGINT, previous)
        for actor in actors:  # done: gone now, before their placement group is (which would make them say so)
            ray.kill(actor)
    return code
