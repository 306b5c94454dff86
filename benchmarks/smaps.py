"""A run's process tree, read from ``/proc`` for ``benchmarks.memory``: each process's pages by kind (its
``/proc/PID/smaps``: PSS, RSS, USS and the PSS split into PARTS), its role (from its name and the run directory's
records), and the whole tree sampled every EVERY_S seconds in a thread."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from exchange.records import read_records

MIB = 2**20
PARTS = ("libraries", "inherited", "channel", "checkpoint", "files", "private")
CHANNEL_PREFIX = "/dev/shm/mutual-rl-"  # engine.weights.places.channel_root on a host with /dev/shm
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt")  # weights transformers maps from a checkpoint (mmap)
EVERY_S = 1.0


# ---------------------------------------------------------------- one process's memory, from /proc/PID/smaps


@dataclass
class Mapping:
    path: str
    executable: bool
    rss: int = 0
    pss: int = 0
    private: int = 0


def read_smaps(pid: int | str) -> list[Mapping]:
    """Every mapping of process ``pid`` with its Rss, Pss and private (clean + dirty) bytes."""
    maps: list[Mapping] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if " " in key:  # a mapping's header: "start-end perms offset dev inode [path]"
                fields = line.split(None, 5)
                maps.append(Mapping(fields[5].strip() if len(fields) > 5 else "", "x" in fields[1]))
            elif key in ("Rss", "Pss", "Private_Clean", "Private_Dirty") and maps:
                kib = int(rest.split()[0]) * 1024
                m = maps[-1]
                if key == "Rss":
                    m.rss += kib
                elif key == "Pss":
                    m.pss += kib
                else:
                    m.private += kib
    return maps


def kind_of(m: Mapping, code_paths: set[str]) -> str:
    """Which of PARTS a mapping's pages are (``code_paths``: the files this process maps executable)."""
    if not m.path or m.path.startswith("["):  # heap, stack, anonymous mmaps ([anon:...]), vdso
        return "anon"
    if m.path.startswith(CHANNEL_PREFIX):
        return "channel"
    if m.path in code_paths or re.search(r"\.so(\.[0-9]+)*$", m.path):
        return "libraries"
    return "checkpoint" if m.path.endswith(CHECKPOINT_SUFFIXES) else "files"


def split(maps: list[Mapping]) -> dict[str, int]:
    """PSS, RSS, USS and the PSS split into PARTS (which add up to the PSS)."""
    code = {m.path for m in maps if m.executable and m.path and not m.path.startswith("[")}
    out = dict.fromkeys(("pss", "rss", "uss", *PARTS), 0)
    for m in maps:
        out["pss"] += m.pss
        out["rss"] += m.rss
        out["uss"] += m.private
        kind = kind_of(m, code)
        if kind == "anon":  # shared anonymous pages are copy-on-write ones a fork has not written yet
            out["private"] += m.private
            out["inherited"] += m.pss - m.private
        else:
            out[kind] += m.pss
    return out


def own_memory() -> dict[str, int]:
    return split(read_smaps("self"))


# ---------------------------------------------------------------- who each process is


class RunRoles:
    """Each process's role, from its name and the run directory's records (read as they are written)."""

    def __init__(self, run_dir: Path, launcher: int, models: list[str]):
        self.run_dir, self.launcher, self.models = run_dir, launcher, models
        self.workers: dict[str, tuple[str, str]] = {}  # worker id -> (role, model)
        self.groups: dict[str, list[str]] = {}  # model -> its learner group's members, rank order
        self.actors: dict[int, str] = {}  # pid -> actor name (pids.json)
        self._offset = 0

    def update(self) -> None:
        records, _, self._offset = read_records(self.run_dir, self._offset, growing=True)
        for record in records:
            self.apply(record)
        try:
            self.actors = {pid: name for name, pid in json.loads((self.run_dir / "pids.json").read_text()).items()}
        except (OSError, ValueError):
            pass  # not written yet, or being rewritten

    def apply(self, record: dict) -> None:
        """One metrics.jsonl record: the split (``allocation``), a move (``assign``), a switch done
        (``role_switch``)."""
        event = record.get("event")
        if event == "allocation":
            self.workers.update({w: tuple(rm) for w, rm in record.get("workers", {}).items()})
        elif event == "assign":
            self.workers.update({w: tuple(rm) for w, rm in record.get("changes", {}).items()})
            self.groups.update(record.get("groups", {}))
        elif event == "role_switch":
            self.workers[record["worker"]] = (record["to_role"], record["to_model"])

    def worker_role(self, wid: str) -> str:
        role, model = self.workers.get(wid, ("worker before its role", ""))
        if role == "learner":
            members = self.groups.get(model) or sorted(w for w, rm in self.workers.items() if rm == ("learner", model))
            return f"learner:{model} rank {members.index(wid) if wid in members else 0}"
        return f"{role}:{model}" if model else role

    def label(self, pid: int, name: str, cmdline: str) -> tuple[str, str]:
        """(role, actor name or process name) of one process of the run's tree."""
        if pid == self.launcher:
            return "coordinator", "launcher"
        actor = self.actors.get(pid) or (name[4:] if name.startswith("mrl-") else "")
        if actor == "broker":
            return "broker", actor
        if actor.startswith("prep-"):  # a model's warm start and held-out evaluation (names keep 15 bytes)
            model = next((m for m in self.models if f"prep-{m}".startswith(actor)), actor[5:])
            return f"prep:{model}", f"prep-{model}"
        if actor:
            return self.worker_role(actor), actor
        if "multiprocessing.forkserver" in cmdline:
            return "fork server", "forkserver"
        if "resource_tracker" in cmdline:
            return "resource tracker", "resource_tracker"
        if "policies.sources" in cmdline:
            return "gguf conversion", name
        return f"other:{name}", name


# ---------------------------------------------------------------- sampling a process tree


@dataclass
class Reading:
    pid: int
    actor: str
    role: str
    mem: dict[str, int]


@dataclass
class Sample:
    t: float
    readings: list[Reading]
    shm_bytes: int = 0  # the run's weight-channel files in /dev/shm: resident whether or not a process maps them


def read_tree(root, roles: RunRoles) -> list[Reading]:
    import psutil

    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            role, actor = roles.label(p.pid, p.name(), " ".join(p.cmdline()))
            out.append(Reading(p.pid, actor, role, split(read_smaps(p.pid))))
        except (psutil.Error, OSError):
            continue  # gone meanwhile
    return out


def channel_bytes(launcher: int) -> int:
    """Bytes of the weight-channel files a run's launcher owns (engine.weights.places: an ``owner`` file names it)."""
    from engine.weights.places import OWNER

    total = 0
    for root in Path("/dev/shm").glob("mutual-rl-*"):
        try:
            if root.joinpath(OWNER).read_text().strip() != str(launcher):
                continue
            total += sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())
        except OSError:
            continue
    return total


class TreeMemory:
    """Reads every process under ``pid`` every EVERY_S seconds, in a thread, until ``stop``."""

    def __init__(self, pid: int, roles: RunRoles, every_s: float = EVERY_S):
        import psutil

        self.root, self.roles, self.every_s = psutil.Process(pid), roles, every_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.roles.update()
            t = time.time()
            readings = read_tree(self.root, self.roles)
            if not readings:
                return
            self.samples.append(Sample(t, readings, channel_bytes(self.root.pid)))
            self._stop.wait(self.every_s)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples

