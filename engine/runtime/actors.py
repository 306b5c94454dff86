"""Process runtime for actors: spawn, watch, stop; no orphans, no hangs.

Every actor is a spawned process (torch.multiprocessing, ``spawn`` start method)
running ``actor_main(entry, payload)``: it pins torch to its thread budget, starts
a watchdog thread that ends the process if the coordinator disappears (so a killed
coordinator leaves no orphans), and runs the actor's coroutine on uvloop. Signals meant
for the process group are ignored: the coordinator stops its actors by message.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)  # the coordinator died: leave at once, nobody will stop us


def actor_main(entry: str, payload: bytes, parent_pid: int, threads: int) -> None:
    """Child-process entry: ``entry`` is "module:function" taking the payload bytes; a coroutine
    function runs on uvloop, a plain function runs as is."""
    # Ctrl-C (SIGINT) goes to the whole process group, and so does a scheduler's SIGTERM: the
    # coordinator decides when and how we stop (it halts us by message, SIGKILL as the last resort).
    # `spawn` started us with both blocked, so one that came while Python started up is dropped here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    import inspect

    import torch
    import uvloop

    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    module_name, func_name = entry.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        result = func(payload)
        code = uvloop.run(result) if inspect.iscoroutine(result) else result
    except KeyboardInterrupt:
        code = 130
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # report and die loudly; the coordinator notices the exit code
        import traceback

        print(f"[{entry}] crashed: {exc!r}", file=sys.stderr, flush=True)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))  # skip interpreter teardown: gloo/zmq threads must not hang the exit


@dataclass
class Actor:
    name: str
    process: mp.Process
    started: float = field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


def spawn(name: str, entry: str, payload: bytes, threads: int = 1) -> Actor:
    proc = _CTX.Process(target=actor_main, args=(entry, payload, os.getpid(), threads), name=name, daemon=False)
    # The child inherits this mask: a Ctrl-C while it imports would otherwise print a KeyboardInterrupt
    # traceback from Python's start-up. Ours is restored at once; a signal that came meanwhile is delivered then.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return Actor(name=name, process=proc)


def stop_all(actors: list[Actor], grace_s: float = 10.0) -> None:
    """Wait up to ``grace_s`` for actors to exit, then SIGTERM (a plain process), then SIGKILL."""
    deadline = time.time() + grace_s
    for actor in actors:
        actor.process.join(timeout=max(0.0, deadline - time.time()))
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        left = [a for a in actors if a.alive]
        if not left:
            return
        for actor in left:
            try:
                os.kill(actor.process.pid, sig)
            except ProcessLookupError:
                pass
        for actor in left:
            actor.process.join(timeout=wait)
