"""Two machines on this host that share nothing but a folder: network namespaces joined by a veth pair (each its own
address, loopback and routes), and each launcher in a mount namespace of its own with a fresh /tmp and /dev/shm
(no ipc socket, shared-memory channel or temporary file of one node is seen by the other). Only ``shared``, a
folder outside /tmp, is seen by both, as a cluster's shared filesystem is. Needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def why_not() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if Path("/tmp") in (ROOT, *ROOT.parents) or Path("/tmp") in Path(sys.executable).resolve().parents:
        return f"the checkout ({ROOT}) or Python lies under /tmp, which each machine has its own of"
    if os.geteuid() != 0:
        return "network and mount namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no ip (iproute2) or unshare (util-linux)"
    probe = f"mrl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.strip()}"


@contextlib.contextmanager
def two_machines(subnet: str = "10.77.0"):
    """Yields [(prefix, address)] for node 0 and node 1: ``[*prefix, *command]`` runs a command on that machine
    (its network, its /tmp and /dev/shm, the same for every command on it). Everything is removed at the end."""
    tag = uuid.uuid4().hex[:6]
    names, links = [f"mrl-{tag}-0", f"mrl-{tag}-1"], [f"mrl{tag}a", f"mrl{tag}b"]
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    holders: list[subprocess.Popen] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for name in names:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, address, link in zip(names, addresses, links):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
            # the machine's own mounts, held by a process every command then enters (nsenter)
            holders.append(subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                 "mount -t tmpfs mrl-tmp /tmp && mount -t tmpfs mrl-shm /dev/shm && echo ready && exec sleep 86400"],
                stdout=subprocess.PIPE, text=True))
            if holders[-1].stdout.readline().strip() != "ready":
                raise RuntimeError(f"machine {name}: its /tmp and /dev/shm could not be mounted")
        yield [(["nsenter", "-t", str(h.pid), "-m", "-n", "--"], a) for h, a in zip(holders, addresses)]
    finally:
        for h in holders:
            h.kill()
            h.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
