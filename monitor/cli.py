"""``launch.py monitor TARGET``: the live web view of a run (or a replay of a finished one).

TARGET running (no run_result.json, FAILED or INTERRUPTED yet): attach to its exchange as a
lossy subscriber and tail its metrics. TARGET finished (or ``--replay``): replay its experience
log and metrics at ``--speed``. ``--once`` prints one plain-text snapshot and exits. ``--wandb``
logs its metrics to Weights & Biases (``monitor.wandb_sink``) and exits once the run has ended. Bad
input is one sentence on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import webbrowser
from pathlib import Path

import uvloop

from exchange.cli import add_curve_args, curve_keys

MONITOR_NICE = 10


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("monitor", help="watch a run live in the browser (or replay a finished one)")
    p.add_argument("target", metavar="RUN_DIR", help="a running run's directory, or a finished run's (replayed)")
    p.add_argument("--port", type=int, default=8765, help="port of the page (default: %(default)s; 0: any free)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s, this machine only)")
    p.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    p.add_argument("--speed", type=float, default=5.0,
                   help="replay pace, times the original (default: %(default)s; 0: as fast as possible)")
    p.add_argument("--replay", action="store_true", help="replay the run's files even if it is still running")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("--attach-timeout", type=float, default=5.0, help="seconds to wait for the run's broker")
    p.add_argument("--wandb", nargs="?", const="offline", choices=("offline", "online"), metavar="MODE",
                   help="log the run's metrics to Weights & Biases instead (offline unless MODE is online: "
                        "RUN_DIR/wandb/, then `wandb sync`), following a running run until it ends")
    add_curve_args(p)  # a run with keys (a cluster) names its own files in endpoints.json: these override them
    p.set_defaults(handler=monitor_command)


def monitor_command(args: argparse.Namespace) -> int:
    from monitor.sources import MonitorError

    with contextlib.suppress(OSError):
        os.nice(MONITOR_NICE)  # on shared cores the run's workers come first: watching must not slow training
    if args.speed < 0:
        print(f"error: --speed {args.speed:g}: must be 0 (as fast as possible) or more", file=sys.stderr)
        return 2
    try:
        return _wandb(args) if args.wandb else uvloop.run(_monitor(args))  # as the engine's actors: a cheaper loop
    except MonitorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _wandb(args: argparse.Namespace) -> int:
    import importlib.util

    from monitor.sources import MonitorError, check_run_dir, is_finished
    from monitor.wandb_sink import INSTALL, export, logged

    run_dir = Path(args.target)
    check_run_dir(run_dir)
    if importlib.util.find_spec("wandb") is None:
        raise MonitorError(f"--wandb needs the wandb package, which is not installed; {INSTALL}")
    where = export(run_dir, args.wandb, lambda: is_finished(run_dir))
    if where is None:
        return 1
    print(logged(run_dir, args.wandb, where), flush=True)
    return 0


async def _monitor(args: argparse.Namespace) -> int:
    from monitor.live import LiveState
    from monitor.sources import (Attached, check_run_dir, endpoint_of, is_finished, models_of, read_experiences, replay,
                                 tail_metrics)

    run_dir = Path(args.target)
    check_run_dir(run_dir)
    state = LiveState(models_of(run_dir), run=run_dir.name)
    live = not args.replay and not is_finished(run_dir)
    tasks = []
    if live:
        endpoint, keys = endpoint_of(run_dir)
        attached = Attached(endpoint, run_dir, curve_keys(args, "monitor") or keys)
        await attached.ready(args.attach_timeout)
        tasks = [asyncio.create_task(attached.feed(state)), asyncio.create_task(tail_metrics(state, run_dir))]
    else:
        state.mode = "replay"
        experiences = read_experiences(run_dir)  # a damaged log fails now, before anything is served
        if args.once:
            await replay(state, run_dir, 0, experiences)
            print(state.text())
            return 0
        tasks = [asyncio.create_task(replay(state, run_dir, args.speed, experiences))]
    try:
        if args.once:
            await asyncio.sleep(2.0)  # one broker Stats window and a metrics poll
            print(state.text())
            return 0
        return await _serve(args, state, run_dir, tasks)
    finally:
        for t in tasks:
            t.cancel()
        if live:
            attached.close()


async def _serve(args: argparse.Namespace, state, run_dir: Path, tasks: list) -> int:
    from monitor.server import MonitorServer
    from monitor.sources import MonitorError
    from monitor.story import Storyteller

    server = MonitorServer(state, Storyteller(run_dir))
    try:
        listening = await server.start(args.host, args.port)
    except OSError as exc:
        raise MonitorError(f"--host {args.host} --port {args.port}: cannot serve there ({exc.strerror}); "
                           "choose another port (0: any free one)") from None
    host, port = listening.sockets[0].getsockname()[:2]
    url = f"http://{host}:{port}/"
    print(f"monitor: {url} ({state.mode} of {run_dir}; Ctrl-C to stop)", flush=True)
    if not args.no_browser and (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin"):
        with contextlib.suppress(Exception):
            webbrowser.open(url)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # as the engine's coordinator does: a Ctrl-C, or a kill -INT of a
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)  # monitor a shell started with SIGINT ignored
    async with listening:
        await stop.wait()
    return 0
