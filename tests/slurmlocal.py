"""A real one-node Slurm on this machine, for the tests: its own munged, slurmctld and slurmd (Debian's slurm-wlm
and munge), their config, state and sockets in a temporary folder, stopped at the end. ``SLURM_CONF`` in the
environment it gives points every Slurm command there."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")


def why_not() -> str | None:
    """Why a local Slurm cannot start here (None: it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"no {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run installs them)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users only when started as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_slurm(folder: Path, timeout_s: float = 60.0):
    """Starts the three daemons; yields the environment for sbatch, squeue and scontrol."""
    host = socket.gethostname().split(".")[0]
    munge = folder / "munge"
    for sub in ("munge", "state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (munge / "munge.key").write_bytes(os.urandom(128))
    (munge / "munge.key").chmod(0o600)
    sock = munge / "munge.sock"
    memory = int(psutil.virtual_memory().total / 2**20 * 0.9)
    (folder / "slurm.conf").write_text(f"""\
ClusterName=mrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=60
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={max(os.cpu_count(), 16)} RealMemory={memory} State=UNKNOWN
PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    procs = [subprocess.Popen(["munged", "--foreground", "--force", f"--socket={sock}",
                               f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munge.seed'}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    try:
        _wait(lambda: sock.exists(), timeout_s, "munged made no socket")
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([daemon, "-D"], env=env, stdout=open(folder / "log" / f"{daemon}.out", "w"),
                                          stderr=subprocess.STDOUT))
        _wait(lambda: " idle" in subprocess.run(["sinfo", "-h", "-o", "%P %t"], env=env, capture_output=True,
                                                 text=True).stdout, timeout_s, "the node did not come up idle")
        yield env
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def job_state(env: dict, job: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "UNKNOWN")


def wait_job(env: dict, job: str, timeout_s: float) -> str:
    """The job's end state (COMPLETED, FAILED, CANCELLED, ...), waited for; a job Slurm will never start (it asks
    for more than the node has) fails at once, saying why."""
    ends = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    def ended() -> bool:
        shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        if "Reason=PartitionConfig" in shown or "Reason=BadConstraints" in shown:
            raise AssertionError(f"job {job} can never start here: {shown.split('Reason=')[1].split()[0]}")
        return job_state(env, job) in ends

    _wait(ended, timeout_s, f"job {job} did not end")
    return job_state(env, job)


def _wait(ready, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not ready():
        if time.time() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        time.sleep(0.2)
