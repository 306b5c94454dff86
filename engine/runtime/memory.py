"""This machine's memory as a run sees it: what is available, and whether a worker that died by SIGKILL died
while it was short.

Available is the kernel's ``MemAvailable``, or what a cgroup limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``, of this process's cgroup or any above it) leaves, where that is smaller: a
container sees the host's meminfo, and its limit is what the out-of-memory killer enforces.

The out-of-memory killer sends SIGKILL and says so only in the kernel's log, which a run seldom can read
(dmesg needs privileges). So a worker's SIGKILL is judged by the memory the run saw around it: the watch
samples it five times a second (``MemoryWatch.sample``), and the death is judged on the lowest reading of the
last ``WINDOW_S`` seconds, because the killed process's memory comes back the moment it is gone. The
kernel's count of out-of-memory kills (``oom_kill`` in /proc/vmstat) rising in that window counts too.
"""

from __future__ import annotations

import collections
import functools
import signal
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 2 ** 30
SHORT_FRACTION = 0.10  # memory is short below this fraction of the total ...
SHORT_FLOOR = 1 * GIB  # ... or below this, whichever is larger (run.memory_short_gib = 0)
WINDOW_S = 10.0  # how far back a death looks for short memory (a kill frees memory at once)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 2 ** 60  # cgroup v1 says "no limit" with a page-rounded 2**63


@dataclass(frozen=True)
class Reading:
    available: int  # bytes a run can still take
    total: int  # bytes it could have (the machine's, or its cgroup's limit)
    oom_kills: int | None  # the kernel's count of out-of-memory kills since boot; None where unreadable
    at: float = 0.0


def read() -> Reading:
    """Available and total memory now, with the cgroup's limit applied where it is tighter."""
    info = _meminfo()
    available, total = info.get("MemAvailable", info.get("MemFree", 0)), info.get("MemTotal", 0)
    for limit, usage in _cgroup_limits():
        if limit < total:
            total, available = limit, min(available, max(0, limit - usage))
    return Reading(available, total, _oom_kills(), time.time())


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def lower_it(cfg) -> str:
    """The settings that lower a run's peak memory, with their values: said by the refusal before a run and by
    the report of an out-of-memory kill during one."""
    t = cfg.train
    return (f"fewer pool.workers ({cfg.pool.workers}), more train.grad_accum micro-batches ({t.grad_accum}), a smaller "
            f"train.prompts_per_step ({t.prompts_per_step}) or train.group_size ({t.group_size}), or LoRA ([models.lora])")


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _oom_kills() -> int | None:
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _cgroup_limits() -> list[tuple[int, int]]:
    """(limit, usage) of this process's memory cgroup and every cgroup above it that sets a limit."""
    out = []
    for directory, limit_file, usage_file in _cgroup_dirs():
        limit, usage = _number(directory / limit_file), _number(directory / usage_file)
        if limit is not None and usage is not None and limit < _UNLIMITED:
            out.append((limit, usage))
    return out


@functools.cache  # a process stays in its cgroup: the watch reads the limits five times a second
def _cgroup_dirs() -> list[tuple[Path, str, str]]:
    """The memory cgroup directories from this process's up to the root: v2 (``0::/path``) or v1 (``N:memory:/path``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = _CGROUP_ROOT, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = _CGROUP_ROOT / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        here = Path(path.strip() or "/")
        for part in [here, *here.parents]:  # a limit above ours binds us too
            directory = base / str(part).lstrip("/")
            if directory.is_dir():
                out.append((directory, *files))
    return out


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def short_threshold(short_gib: float, total: int) -> int:
    """Bytes below which memory is short: ``run.memory_short_gib``, or (0) a tenth of the total but at least 1 GiB."""
    return int(short_gib * GIB) if short_gib > 0 else max(SHORT_FLOOR, int(SHORT_FRACTION * total))


class MemoryWatch:
    """Memory readings of the last ``WINDOW_S`` seconds, for judging a worker's SIGKILL when it is noticed."""

    def __init__(self, short_gib: float = 0.0):
        self.short_gib = short_gib
        self.samples: collections.deque[Reading] = collections.deque()

    def sample(self) -> None:
        now = read()
        self.samples.append(now)
        while self.samples and self.samples[0].at < now.at - WINDOW_S:
            self.samples.popleft()

    def killed_short(self, exitcode: int | None) -> str | None:
        """How a process that ended with ``exitcode`` died, when it was a SIGKILL while memory was short (or as
        the kernel counted an out-of-memory kill): the phrase that says so; None for any other death."""
        if exitcode != -signal.SIGKILL:
            return None
        self.sample()
        low = min(self.samples, key=lambda r: r.available)
        kills = [r.oom_kills for r in self.samples if r.oom_kills is not None]
        counted = len(kills) > 1 and kills[-1] > kills[0]
        if low.available >= short_threshold(self.short_gib, low.total) and not counted:
            return None
        seen = f"{gib(low.available)} available of {gib(low.total)}"
        when = (f"while memory was short ({seen})" if low.available < short_threshold(self.short_gib, low.total)
                else f"as the kernel counted an out-of-memory kill ({seen})")
        return f"was killed by SIGKILL {when}: likely the kernel's out-of-memory killer"
