"""math-verify with a deadline that holds in any thread: the check runs in a child process.

math-verify's own time-outs use SIGALRM, which works only in a process's main thread, and
cannot interrupt a long C call either (``9^{9^{9^{9}}}`` is one big-integer power). In the
child, its time-outs are on (the child calls it from its main thread); the parent waits
at most ``deadline_s`` and kills the child if even that was not enough. A completion that
runs out of time is judged wrong (reward 0) and counted by the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

STARTUP_S = 120  # importing math-verify (sympy) in the child, on a loaded machine


def _serve(conn: Connection, inner_timeout: int) -> None:
    import functools

    import math_verify

    gold_of = functools.lru_cache(maxsize=4096)(lambda text: math_verify.parse(text, parsing_timeout=inner_timeout))
    # a first check loads the parser's grammar and sympy's lazy parts (0.1 s here, a few times that on a loaded
    # machine): done before "ready", so the first real check is not judged against the deadline for it
    math_verify.verify(math_verify.parse("$4$"), math_verify.parse("$2+2$"))
    conn.send("ready")
    while True:
        try:
            gold_text, completion = conn.recv()
        except EOFError:
            return
        started = time.monotonic()
        try:
            gold = gold_of(gold_text)
            predicted = math_verify.parse(completion, parsing_timeout=inner_timeout)
            ok = bool(predicted) and bool(math_verify.verify(gold, predicted, timeout_seconds=inner_timeout))
        except Exception:  # math-verify raises on some hostile input: that is a wrong answer
            ok = False
        # math-verify answers False when its own time-out fires: say it was a time-out
        conn.send(None if time.monotonic() - started >= inner_timeout else ok)


class BoundedVerifier:
    """``check(gold, completion)``: True/False, or None when it did not finish within ``deadline_s``."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.timeouts = 0
        self._conn: Connection | None = None
        self._proc: mp.process.BaseProcess | None = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, max(1, int(self.deadline_s / 2))), daemon=True,
                                 name="math-verify")
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(STARTUP_S) or parent.recv() != "ready":  # importing math-verify is not the check's time
            self.close()
            raise RuntimeError(f"the math-verify process did not start within {STARTUP_S}s")

    def check(self, gold_text: str, completion: str) -> bool | None:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((gold_text, completion))
        if self._conn.poll(self.deadline_s):
            try:
                answer = self._conn.recv()
            except EOFError:
                answer = None  # the child died (out of memory on a hostile input): a time-out as well
                self.close()
            if answer is None:
                self.timeouts += 1
            return answer
        self.timeouts += 1
        self.close()  # a hung check cannot be cancelled: the next one gets a fresh child
        return None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
            self._proc = self._conn = None
