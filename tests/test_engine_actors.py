"""Actor processes (engine.runtime.actors): what an actor sends last reaches the coordinator, though it
leaves with ``os._exit``; the fork server hands every actor the run's tokenizers, loaded once."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine.runtime import actors
from engine.runtime.plane import CoordinatorPlane, LearnerFinal, WorkerPlane

BIG = 200_000_000  # bytes: ZeroMQ's I/O thread is still writing them when the actor returns


async def _last_words(endpoint: str) -> int:
    plane = WorkerPlane(endpoint, "w-last")
    await plane.send(LearnerFinal("m", 7, [1, 2], "c" * BIG, 0.5, 0.1, 10, 1, 2, 3, True))
    plane.close()  # as a worker leaves after its learner's final: close, then the actor's os._exit
    return 0


def last_words(payload: bytes):
    return _last_words(msgspec.msgpack.decode(payload))


async def _left_open(endpoint: str) -> int:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, -1)  # holds its message for ever: nothing listens at the endpoint
    sock.connect(endpoint)
    await sock.send(b"nobody hears this")
    return 0  # the socket is left open: terminating its context alone would wait for ever


def left_open(payload: bytes):
    return _left_open(msgspec.msgpack.decode(payload))


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_an_actor_that_leaves_a_socket_open_still_exits(tmp_path):
    actor = actors.spawn("left-open", "tests.test_engine_actors:left_open",
                         msgspec.msgpack.encode(f"ipc://{tmp_path}/nobody"))
    actor.process.join(60)
    alive = actor.alive
    actors.stop_all([actor], 0)
    assert not alive and actor.exitcode == 0


def test_the_last_message_of_an_actor_reaches_the_coordinator(tmp_path):
    async def main():
        coord = CoordinatorPlane(f"ipc://{tmp_path}/plane")
        actor = actors.spawn("last-words", "tests.test_engine_actors:last_words",
                             msgspec.msgpack.encode(f"ipc://{tmp_path}/plane"))
        try:
            worker, msg = await asyncio.wait_for(coord.recv(), 60)
        finally:
            await asyncio.to_thread(actors.stop_all, [actor], 60)
            coord.close()
        return worker, msg, actor.exitcode

    worker, msg, code = asyncio.run(main())
    assert worker == "w-last" and isinstance(msg, LearnerFinal) and code == 0
    assert msg.queued_prompt_ids == [1, 2] and len(msg.checkpoint) == BIG


PRELOAD_PROBE = """
import time

from engine.config import tokenizer_cache


def in_a_fork(cfg):
    from tokenbridge.loading import _PRELOADED, load_tokenizer
    from tokenbridge.profile import _PROFILES

    started = time.process_time()
    toks = [load_tokenizer(m.tokenizer, tokenizer_cache(cfg)) for m in cfg.models]
    return {"preloaded": sorted(name for name, _ in _PRELOADED), "same": all(
        t is _PRELOADED[(m.tokenizer, tokenizer_cache(cfg))] for t, m in zip(toks, cfg.models)),
        "profiled": all(t in _PROFILES for t in toks), "load_cpu_s": time.process_time() - started}
"""
PRELOAD_CHECK = """
import json, sys
from engine.config import load_run_config
from engine.runtime import actors
from engine.runtime.preload import spec_for
from probe import in_a_fork

cfg = load_run_config("configs/smoke.toml", [f"run.cache_dir='{sys.argv[1]}'", *sys.argv[2:]])
actors.start_server(spec_for(cfg))
print("RESULT", json.dumps(actors.call_forked(in_a_fork, cfg)))
actors.stop_server()
"""


@pytest.mark.slow  # a fresh interpreter and its fork server (~8 s of CPU)
def test_the_fork_server_loads_the_runs_tokenizers_once_for_every_actor(tmp_path):
    """Each fork gets the run's tokenizers (and, for a run of several models, their profiles) from the server:
    no actor parses them again. A tokenizer the server could not load is the actor's to load (and to name)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "check.py"
    script.write_text(PRELOAD_CHECK)
    (tmp_path / "probe.py").write_text(PRELOAD_PROBE)  # what the fork runs: a module's (a script's is not reloaded)

    def run(*sets):
        return subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), *sets], cwd=root,
                              capture_output=True, text=True, timeout=300, check=False)

    out = run()
    said = json.loads(out.stdout.split("RESULT ", 1)[1]) if "RESULT " in out.stdout else out.stdout + out.stderr
    assert said["preloaded"] == ["gpt2", "mistral"] and said["same"] and said["profiled"], said
    assert said["load_cpu_s"] < 0.05, said  # a dict look-up each; a load takes 0.3 s of CPU here
    absent = tmp_path / "absent"
    absent.mkdir()  # a directory with no tokenizer: the server skips it, the actor's own load says why
    out = run(f"models.1.tokenizer='{absent}'")
    assert out.returncode != 0 and f"directory {absent} holds no tokenizer" in out.stderr, out.stderr[-2000:]
    assert "TokenizerLoadError" in out.stderr  # raised in the fork, re-raised here: the server went on serving
