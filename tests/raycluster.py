"""A real Ray cluster of two nodes for the tests: ``ray start --head`` on machine 0 and ``ray start --address`` on
machine 1 (tests/netns.py: each its own network, /tmp and /dev/shm), each with its own CPUs; stopped at the end."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
PORT = 6379


def why_not() -> str | None:
    if importlib.util.find_spec("ray") is None or not Path(RAY).exists():
        return "ray is not installed (pip install -c constraints.txt -e '.[ray]')"
    return None


@contextlib.contextmanager
def ray_cluster(machines, cpus: int = 3, timeout_s: float = 120.0):
    """Yields the head's address (host:port); both nodes' Ray processes are gone at the end."""
    (on0, addr0), (on1, addr1) = machines
    quiet = ["--disable-usage-stats", f"--num-cpus={cpus}", "--num-gpus=0", "--object-store-memory=100000000"]
    # no memory monitor: in a sandbox without cgroup memory figures it warns every 5 s, and nothing here needs it;
    # no idle Python workers started ahead (each imports Ray: CPU the suite's other tests need), a small object store
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
           "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
    before = {p.pid for p in psutil.process_iter()}
    try:
        subprocess.run([*on0, RAY, "start", "--head", f"--node-ip-address={addr0}", f"--port={PORT}",
                        "--include-dashboard=false", *quiet],
                       env=env, check=True, capture_output=True, text=True, timeout=timeout_s)
        subprocess.run([*on1, RAY, "start", f"--address={addr0}:{PORT}", f"--node-ip-address={addr1}", *quiet],
                       env=env, check=True, capture_output=True, text=True, timeout=timeout_s)
        yield f"{addr0}:{PORT}"
    finally:
        ours = [p for p in psutil.process_iter() if p.pid not in before and _is_ray(p)]
        for p in ours:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(ours, timeout=30)


def raylet_of(address: str) -> psutil.Process:
    """The raylet of the node at ``address`` (to kill it: the node is lost)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "raylet" in (p.info["name"] or "") and f"--node_ip_address={address}" in cmd:
                return p
        time.sleep(0.5)
    raise AssertionError(f"no raylet of {address} found")


def _is_ray(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "/ray/" in cmd or any(k in cmd for k in ("raylet", "gcs_server", "ray::", "default_worker"))
