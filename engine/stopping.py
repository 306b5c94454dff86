"""The end of a run, one path whatever triggers it (every model done, the time limit, Ctrl-C/SIGTERM, a
failure): generators halt first (their last experience reaches the log), then learners (leaders
checkpoint and evaluate), then every process is stopped (join, then SIGKILL), so no process,
socket or shared-memory slot outlives the run. ``run`` is the ``engine.coordinator.Coordinator``.
"""

from __future__ import annotations

import asyncio
import shutil
import time

from engine.runtime import actors
from engine.runtime.hub import stop_broker
from engine.runtime.plane import END_OF_RUN, REWARD_FAILED, Halt


async def halt(run) -> None:
    """Generators first (their last units reach the log), then learners (leaders checkpoint and evaluate)."""
    run.stopping = True
    t = run.cfg.timeouts
    others = [w for w, (r, _) in run.roster.assignment.items() if r != "learner"]
    await run.send_all([(w, Halt(END_OF_RUN)) for w in others])
    await _wait_exit(run, others, t.halt_s)
    learners = [w for w, (r, _) in run.roster.assignment.items() if r == "learner"]
    reason = REWARD_FAILED if run.failures.stop_now else END_OF_RUN  # stop_now: a reward function failed
    await run.send_all([(w, Halt(reason)) for w in learners])
    owed = [m for m in run.names if m not in run.failures.left]
    deadline = time.time() + t.final_s
    while (not all(m in run.finals for m in owed) and time.time() < deadline and _any_alive(run, learners)
           and not run.failures.fatal):
        await run.wait_changed(1.0)
    grace = time.time() + t.stop_s  # a learner's final, sent just before its process exited, may still be in the plane
    while not all(m in run.finals for m in owed) and time.time() < grace and not run.failures.fatal:
        await run.wait_changed(0.1)
    missing = [m for m in owed if m not in run.finals]
    if missing and not run.failures.aborted:  # (aborted: the user skipped them)
        run.failures.fail(f"no final checkpoint and evaluation from {', '.join(missing)} "
                          f"(timeouts.final_s={t.final_s:g})")


async def _wait_exit(run, workers: list[str], timeout: float) -> None:
    deadline = time.time() + timeout
    while _any_alive(run, workers) and time.time() < deadline and not run.failures.fatal:
        await run.wait_changed(0.1)


def _any_alive(run, workers: list[str]) -> bool:
    return any(run.actors[w].alive for w in workers if w in run.actors)


async def shutdown(run) -> None:
    """Every process stopped (the broker last, after the workers), every socket, writer and temporary folder closed."""
    run.stopping = True
    for task in [*getattr(run, "tasks", []), getattr(run.failures, "watch", None)]:
        if task is not None:
            task.cancel()
    procs, grace = list(run.actors.values()), run.cfg.timeouts.stop_s
    if hasattr(run, "plane"):  # a failed run skipped the halt: its workers are still told to stop, not left to
        halt = Halt(END_OF_RUN)  # wait out the grace (after a halt they are gone already: nothing is sent)
        await run.send_all([(name, halt) for name, a in run.actors.items() if name != "broker" and a.alive])
    await asyncio.to_thread(actors.stop_all, [a for a in procs if a.name != "broker" and a.local], grace)
    if run.nodes is not None:
        await run.nodes.stop(grace)  # every other node stops the workers it runs for us
    if hasattr(run, "sub"):  # nobody reads our own subscription any more; the broker's stop waits (drain_timeout_s)
        run.sub.close()  # for every subscriber still listed to answer its Closing: say goodbye first
    if "broker" in run.actors and run.actors["broker"].alive:
        try:
            await asyncio.wait_for(stop_broker(run.pub), grace)
        except (TimeoutError, OSError):
            pass  # stop_all below ends it
    await asyncio.to_thread(actors.stop_all, [a for a in procs if a.name == "broker"], grace)
    await asyncio.to_thread(actors.stop_all, getattr(run, "prep_actors", []), 0.0)
    for closer in ("pub", "plane", "metrics", "weights_hub", "relay"):
        if hasattr(run, closer):
            getattr(run, closer).close()
    if getattr(run, "curve", None) is not None:
        run.curve.stop()  # the CurveZMQ authenticator's thread, once every socket it served is closed
    if hasattr(run, "weights_root"):
        shutil.rmtree(run.weights_root, ignore_errors=True)
    shutil.rmtree(run.sock_dir, ignore_errors=True)
