"""Actor processes (engine.runtime.actors): what an actor sends last reaches the coordinator, though it
leaves with ``os._exit``."""

from __future__ import annotations

import asyncio

import msgspec

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
