"""Actor processes (engine.runtime.actors): what an actor sends last reaches the coordinator, though it
leaves with ``os._exit``."""

from __future__ import annotations

import asyncio

import pytest
import msgspec
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
