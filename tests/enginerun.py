"""A `launch.py run` process for the engine tests: started as a user starts it, watched, signalled, killed.

Waits are for events (a step in metrics.jsonl, a line on the output); each has a deadline
that fails the test, never a bare sleep that hopes enough happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


class Run:
    """``launch.py run`` in its own session (so a Ctrl-C reaches its whole process group, as in a terminal)."""

    def __init__(self, run_dir: Path, cache: Path | None, *overrides: str, config: str = "configs/smoke.toml",
                 node: tuple[int, int, int] | None = None, env: dict[str, str] | None = None, report: bool = False,
                 machine: tuple[list[str], str] = ((), "127.0.0.1"), flags: tuple[str, ...] = ()):
        """``node``: (nodes, rank, port): this launcher is node ``rank`` of a cluster, started by torchrun as on a
        real cluster (rendezvous at node 0's address:port). ``machine``: (a prefix that runs the launcher as on
        another machine, node 0's address; tests/netns.py), loopback by default. ``report``: the run ends with its
        report (its plots cost a few CPU-seconds a run; tests/test_resume.py checks a run's own,
        tests/test_report.py the rest). ``flags``: more arguments of ``launch.py run`` (``--ignore-memory-check``)."""
        self.run_dir = run_dir
        overrides = (*overrides, f"run.report={str(report).lower()}")
        prefix, host = machine
        launcher = [*prefix, sys.executable, str(ROOT / "launch.py")]
        if node is not None:
            nodes, rank, port = node
            launcher = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                        "--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-endpoint", f"{host}:{port}",
                        str(ROOT / "launch.py")]
        if cache is None:  # `launch.py resume RUN_DIR`: everything comes from the run directory
            args = [*launcher, "resume", str(run_dir)]
            for o in overrides:
                args += ["--set", o]
        else:
            args = [*launcher, "run", "--config", str(ROOT / config), "--run-dir", str(run_dir), *flags]
            for o in (f"run.cache_dir='{cache}'", *overrides):
                args += ["--set", o]
        self._start(args, env)

    @classmethod
    def command(cls, run_dir: Path, *args: str) -> Run:
        """Any ``launch.py`` command (e.g. ``experiment GRID``), started and watched the same way."""
        run = cls.__new__(cls)
        run.run_dir = run_dir
        run._start([sys.executable, str(ROOT / "launch.py"), *args], None)
        return run

    def _start(self, args: list[str], env: dict[str, str] | None) -> None:
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self.lines: list[str] = []
        self.seen: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def track(self) -> None:
        try:
            self.seen.update(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, predicate, what: str, timeout: float = 300) -> None:
        """Poll ``predicate`` until it holds; the run ending first, or the deadline, fails with ``what``."""
        deadline = time.time() + timeout
        while not predicate():
            self.track()
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before {what}:\n{self.out[-3000:]}")
            if time.time() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s:\n{self.out[-3000:]}")
            time.sleep(0.2)

    def wait_steps(self, n: int, model: str | None = None, timeout: float = 300) -> None:
        self.wait_for(lambda: len(self.steps(model)) >= n, f"{n} steps of {model or 'any model'}", timeout)

    def finish(self, timeout: float = 600) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the run did not end within {timeout:.0f}s:\n{self.out[-3000:]}") from None
        self._reader.join(10)
        return self.proc.returncode

    def signal(self, sig: int) -> None:
        """What a terminal's Ctrl-C (SIGINT) does: the signal to the whole foreground process group."""
        self.track()
        os.killpg(self.proc.pid, sig)

    def kill_worker(self, name: str) -> None:
        self.track()
        os.kill(self.pids()[name], signal.SIGKILL)

    def pids(self) -> dict[str, int]:
        return json.loads((self.run_dir / "pids.json").read_text())

    def leftover(self) -> list[int]:
        """Processes of this run still alive after it ended (waits for stragglers up to 10 s)."""
        deadline = time.time() + 10
        while True:
            alive = [p for p in self.seen if is_alive(p)]
            if not alive or time.time() > deadline:
                return alive
            time.sleep(0.2)

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def events(self, event: str, model: str | None = None) -> list[dict]:
        return [r for r in self.records() if r.get("event") == event and (model is None or r["model"] == model)]

    def steps(self, model: str | None = None) -> list[dict]:
        return self.events("step", model)

    def result(self) -> dict:
        return json.loads((self.run_dir / "run_result.json").read_text())


def is_alive(pid: int) -> bool:
    """Running and not a zombie (a process that ends while it is looked at is not alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
