"""Process runtime for actors: spawn, watch, stop; no orphans, no hangs.

Every actor is a process forked from a fork server (multiprocessing, ``forkserver``
start method) running ``actor_main(entry, payload)``: it pins torch to its thread budget,
starts a watchdog thread that ends the process if the coordinator disappears (so a killed
coordinator leaves no orphans), and runs the actor's coroutine on uvloop. Signals meant
for the process group are ignored: the coordinator stops its actors by message.

Why a fork server: importing torch, transformers and our roles costs a process about 6 s of
CPU. The server pays that once per launcher, and every actor is a fork of it that starts at
once (``spawn`` made the broker, four workers and two warm-start processes pay it in parallel,
which on two cores was most of a short run's wall time). The server is single-threaded and
never touches a device, so forking it is safe; it leaves when its launcher does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path

_CTX = mp.get_context("forkserver")
# What every actor imports: loaded once, in the fork server (an import that fails there is only skipped).
_CTX.set_forkserver_preload(["engine.roles.worker", "engine.prep.prepare", "engine.prep.warmstart",
                             "engine.prep.evaluation", "engine.runtime.hub", "tokenbridge.loading", "uvloop",
                             "engine.runtime.preload"])  # last: the run's tokenizers (its docstring)
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
DRAIN_ZMQ_S = 3.0  # how long an exiting actor lets ZeroMQ send what it holds (the worker plane's linger is 2 s)


def start_server(preload: str | None = None) -> None:
    """Start the fork server now (it loads torch and the roles in the background, beside whatever
    this process does next); the first ``spawn`` otherwise starts it and waits for it. ``preload``: what
    it also loads for a run (``engine.runtime.preload.spec_for``); nothing when it is running already.

    The server and every fork of it ignore SIGINT and SIGTERM from birth (an ignored disposition
    survives fork and exec): a Ctrl-C or a scheduler's SIGTERM to the process group is the
    coordinator's to handle, and a server killed by one would take every actor with it."""
    if threading.current_thread() is not threading.main_thread():
        with _main_left_out(), _preloading(preload):
            forkserver.ensure_running()  # signal dispositions can only be changed from the main thread
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:  # a stop signal in these few milliseconds is dropped: the server is started once per process
        with _main_left_out(), _preloading(preload):
            forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _preloading(preload: str | None):
    """``preload`` in the environment the server starts with, and only there (it is this process's)."""
    from engine.runtime.preload import ENV

    if preload is None:
        yield
        return
    os.environ[ENV] = preload
    try:
        yield
    finally:
        os.environ.pop(ENV, None)


@contextlib.contextmanager
def _main_left_out():
    """Processes started meanwhile do not run the caller's script again: multiprocessing re-imports ``__main__``
    in every child (by its file or module name), so a user's script without an ``if __name__ == "__main__":``
    guard would start a second run inside the fork server and every actor. Actors need nothing from it: they
    run "module:function" entries."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def stop_server() -> None:
    """Stop the fork server at once (a command that failed before it started any actor): left alone it
    would finish loading torch before it noticed us gone, holding the terminal's pipes open meanwhile."""
    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)  # it ignores SIGTERM (see ``start_server``)
        server._stop()  # closes the life line, reaps it, removes its socket


def _let_the_server_go() -> None:
    """Close our copy of the fork server's life line. multiprocessing hands every fork the write end
    of the pipe whose EOF tells the server that its launcher is gone: while we held it, a killed
    launcher would leave the server waiting on us and us (see ``_watch_parent``) watching the server."""
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # an actor that starts actors gets a server of its own


def _show_name() -> None:
    """Name the process after its actor (``mrl-w0``, ``mrl-broker``) for top and ps -o comm: every fork of
    the server otherwise shows the server's command line."""
    name = f"mrl-{mp.current_process().name}"[:15].encode()  # the kernel keeps 15 bytes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # 15: PR_SET_NAME (Linux)


def _watch_parent(parent_pid: int, launcher_pid: int | None) -> None:
    while True:
        time.sleep(0.2)
        # the launcher died: the fork server, our parent, follows it only after unloading torch (~2 s), so its
        # death is watched too. Leave at once, with its socket folders (nobody else is left to remove them)
        if os.getppid() != parent_pid or (launcher_pid is not None and not _running(launcher_pid)):
            if launcher_pid is not None:
                from engine.record.rundir import remove_sock_dirs

                remove_sock_dirs(launcher_pid)
            os._exit(3)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed launcher stays one until its shell reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux /proc), or None where it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _drain_zmq(timeout_s: float) -> None:
    """Let ZeroMQ's I/O thread send what closed sockets still hold (their linger) before we leave.

    ``os._exit`` skips the context's termination, and a socket's close only hands its queue to that
    thread: a learner's last plane message (its final evaluation) was lost this way under load. The
    wait is bounded, so a socket left open cannot hang the exit."""
    zmq = sys.modules.get("zmq")
    if zmq is None:
        return
    contexts = [getattr(cls, "_instance", None) for cls in (zmq.Context, getattr(zmq, "asyncio", zmq).Context)]
    for ctx in {id(c): c for c in contexts if c is not None and not c.closed}.values():
        done = threading.Thread(target=ctx.term, daemon=True)
        done.start()
        done.join(timeout_s)


def actor_main(entry: str, payload: bytes, threads: int) -> None:
    """Child-process entry: ``entry`` is "module:function" taking the payload bytes; a coroutine
    function runs on uvloop, a plain function runs as is."""
    # Ctrl-C (SIGINT) goes to the whole process group, and so does a scheduler's SIGTERM: the
    # coordinator decides when and how we stop (it halts us by message, SIGKILL as the last resort).
    # The fork server gave us both ignored already (see ``start_server``); this says so where it matters.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _let_the_server_go()
    _show_name()
    import inspect

    import torch
    import uvloop

    torch.set_num_threads(threads)
    server = os.getppid()  # the fork server, whose parent is the launcher
    threading.Thread(target=_watch_parent, args=(server, _parent_of(server)), daemon=True).start()
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
    _drain_zmq(DRAIN_ZMQ_S)
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

    @property
    def local(self) -> bool:
        """A process of this machine (not one a cluster's node agent runs for us: ``engine.cluster.links``)."""
        return isinstance(self.process, mp.process.BaseProcess)


def spawn(name: str, entry: str, payload: bytes, threads: int = 1) -> Actor:
    proc = _CTX.Process(target=actor_main, args=(entry, payload, threads), name=name, daemon=False)
    start_server()
    with _main_left_out():
        proc.start()
    return Actor(name=name, process=proc)


def call_forked(func, *args):
    """``func(*args)`` run in a fork of the server: its return value here, or its exception raised here.
    For work that needs torch or transformers on behalf of a process that never imports them (the
    launcher's pre-flight); ``func`` and its arguments must pickle."""
    start_server()
    with _main_left_out(), concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=_CTX) as pool:
        return pool.submit(func, *args).result()


def stop_all(actors: list[Actor], grace_s: float = 10.0) -> None:
    """Wait up to ``grace_s`` for actors to exit, then SIGKILL the rest (an actor ignores SIGTERM: see
    ``actor_main``; it is stopped by message, and a SIGTERM would only make its killing wait)."""
    deadline = time.time() + grace_s
    for actor in actors:
        actor.process.join(timeout=max(0.0, deadline - time.time()))
    left = [a for a in actors if a.alive]
    for actor in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor.process.pid, signal.SIGKILL)
    for actor in left:
        actor.process.join(timeout=3.0)
