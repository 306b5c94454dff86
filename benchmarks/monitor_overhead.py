"""What watching costs: the default run's samples/s with a monitor page open and streaming vs without.

Runs alternate, without then with (``--pairs`` times), all real ``launch.py run`` processes on
configs/default.toml (``--steps`` learner steps per model: the default job's RL phase, shortened;
its warm start comes from the cache, made by the first run if missing). "With": ``launch.py monitor RUN_DIR`` attaches as soon as the run writes
endpoints.json, and a client reads its ``/events`` stream (a snapshot every 0.5 s, what an open
page receives) and asks for the latest prompt's story every 3 s, as the page does. The rate
compared is own samples trained per second over the RL phase (the learners' start records to
their last step), summed over models; warm start and final evaluation are excluded. The last
line is JSON with ``ratio`` (with / without, medians); the bar is 0.95. Also reported: the CPU
seconds the monitor used, of which a one-time part (start-up, and loading the tokenizers and THL
bridges for the first prompt's story) weighs more the shorter the run, and those of the page's client
(this process's reader of the stream and the stories: what a browser would spend, or less).

    python -m benchmarks.monitor_overhead [--config configs/default.toml] [--steps 200] [--pairs 2]
                                          [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from exchange.records import read_records

ROOT = Path(__file__).resolve().parents[1]
BAR = 0.95


def run_records(run_dir: Path) -> list[dict]:
    return read_records(run_dir).records


def samples_per_s(records: list[dict]) -> float:
    start = min(r["time"] for r in records if r.get("event") == "start")
    steps = [r for r in records if r.get("event") == "step"]
    last = {}
    for r in steps:
        last[r["model"]] = r
    return sum(r["own_experiences"] for r in last.values()) / (max(r["time"] for r in steps) - start)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch(run_dir: Path, stop: threading.Event) -> dict:
    """Start a monitor on the run and read its page's stream until ``stop``; what it received."""
    while not (run_dir / "endpoints.json").exists():
        if stop.wait(0.2):
            return {}
    mon = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "monitor", str(run_dir), "--port", "0",
                            "--no-browser"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = mon.stdout.readline().split()[1]
    seen = {"events": 0, "stories": 0, "page_cpu_s": 0.0}
    started = time.thread_time()

    def stream() -> None:
        t0 = time.thread_time()
        try:
            with urllib.request.urlopen(url + "events") as r:
                for line in r:
                    if line.startswith(b"data: "):
                        seen["events"] += 1
                        seen["last"] = json.loads(line[6:])
                    if stop.is_set():
                        return
        finally:
            seen["page_cpu_s"] += time.thread_time() - t0

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while not stop.wait(3.0):
        with urllib.request.urlopen(url + "story?prompt=latest") as r:
            seen["stories"] += "prompt_id" in json.loads(r.read())
    seen["monitor_cpu_s"] = _cpu_seconds(mon.pid)
    mon.terminate()
    mon.wait(20)
    reader.join(5)
    seen["page_cpu_s"] += time.thread_time() - started  # the stories' requests, and the stream's reading
    last = seen.pop("last", {})
    seen.update(received=last.get("received", 0), missed=last.get("missed", 0))
    return seen


def paused_s(records: list[dict]) -> float:
    """Seconds the whole machine stood still during the run (the coordinator's ``paused`` records)."""
    return sum(r["seconds"] for r in records if r.get("event") == "paused")


def one_run(work: Path, name: str, config: str, steps: int, sets: list[str], monitored: bool) -> tuple[float, dict]:
    """A run's samples/s; measured again (twice at most) when the machine paused during it (a suspended or
    snapshotted VM stops every process alike, and its seconds would count as the run's)."""
    for attempt in range(3):
        seen, run_dir = _run_once(work, f"{name}-again{attempt}" if attempt else name, config, steps, sets,
                                  monitored)
        records = run_records(run_dir)
        paused = paused_s(records)
        if not paused:
            break
        print(f"{run_dir.name}: the machine stood still for {paused:.0f}s during the run; measured again",
              flush=True)
    return samples_per_s(records), seen


def _run_once(work: Path, name: str, config: str, steps: int, sets: list[str], monitored: bool):
    run_dir = work / name
    args = [sys.executable, str(ROOT / "launch.py"), "run", "--config", config,
            "--run-dir", str(run_dir), "--set", f"train.steps={steps}", "--set", "run.max_minutes=15"]
    for s in sets:
        args += ["--set", s]
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(target=lambda: seen.update(watch(run_dir, stop))) if monitored else None
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    if watcher:
        watcher.start()
    code = proc.wait()
    stop.set()
    if watcher:
        watcher.join(60)
    if code != 0:
        raise SystemExit(f"{name}: launch.py run exited {code}; see {run_dir}")
    return seen, run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/default.toml"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="monitor-overhead-"))
    without, with_, cpu, page_cpu = [], [], [], []
    for k in range(args.pairs):
        rate, _ = one_run(work, f"plain-{k}", args.config, args.steps, args.sets, False)
        without.append(rate)
        rate, seen = one_run(work, f"watched-{k}", args.config, args.steps, args.sets, True)
        with_.append(rate)
        print(f"pair {k}: without {without[-1]:.1f} samples/s, with a monitor {rate:.1f} samples/s "
              f"(page got {seen.get('events', 0)} snapshots, {seen.get('stories', 0)} stories; monitor saw "
              f"{seen.get('received', 0)} experiences, missed {seen.get('missed', 0)}; it used "
              f"{seen.get('monitor_cpu_s', 0):.1f} CPU-s, the page's client {seen.get('page_cpu_s', 0):.1f})",
              flush=True)
        cpu.append(seen.get("monitor_cpu_s", 0.0))
        page_cpu.append(seen.get("page_cpu_s", 0.0))
    ratio = statistics.median(with_) / statistics.median(without)
    print(json.dumps({"without_samples_per_s": [round(x, 1) for x in without],
                      "with_monitor_samples_per_s": [round(x, 1) for x in with_], "ratio": round(ratio, 3),
                      "bar": BAR, "passes": ratio >= BAR, "steps": args.steps,
                      "config": Path(args.config).name, "monitor_cpu_s": [round(x, 1) for x in cpu],
                      "page_client_cpu_s": [round(x, 1) for x in page_cpu]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
