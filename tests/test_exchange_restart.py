"""A broker killed (SIGKILL) and started again on the same endpoints and log loses nothing.

Publishers re-send what the dead broker never confirmed; the new broker reopens the log and
refuses the ids it holds already; subscribers re-subscribe on their own.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal

import pytest

from exchange.blocking_publisher import BlockingPublisher
from exchange.broker import BrokerConfig, spawn_broker
from exchange.log import ExperienceLogReader, ExperienceLogWriter
from exchange.protocol import Experience, Stats
from exchange.publisher import Publisher
from exchange.samples import make_experience
from exchange.subscriber import Subscriber

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path) -> BrokerConfig:
    return BrokerConfig(frontend=f"ipc://{tmp_path}/front", backend=f"ipc://{tmp_path}/back",
                        log_dir=str(tmp_path / "log"), stats_interval_s=0.05, drain_timeout_s=5.0)


async def _receive_all(sub: Subscriber, seen: collections.Counter, stats: list) -> None:
    while True:
        for m in await sub.recv_batch():
            if isinstance(m, Experience):
                seen[m.experience_id] += 1
            elif isinstance(m, Stats) and m.role == "broker":
                stats.append(m)


def test_a_killed_broker_restarted_on_its_endpoints_loses_and_repeats_nothing(tmp_path):
    cfg = _config(tmp_path)

    async def main() -> tuple[collections.Counter, Stats, Publisher]:
        broker = spawn_broker(cfg)
        sub = Subscriber(cfg.backend, ["exp.", "stats"], name="learner", lossless=True, resubscribe_s=0.2)
        await sub.ready(timeout=30)
        pub = Publisher(cfg.frontend, max_batch=32, resend_every_s=0.5)
        first = [make_experience(i, "m0", completion_tokens=16, text_chars=40) for i in range(200)]
        for exp in first:
            await pub.send(exp)
        await pub.sync(timeout=30)  # confirmed: never sent again
        seen: collections.Counter = collections.Counter()
        stats: list[Stats] = []
        receiving = asyncio.create_task(_receive_all(sub, seen, stats))  # a learner's listener never stops
        await _until(lambda: len(seen) == 200, 30)
        second = [make_experience(i, "m0", completion_tokens=16, text_chars=40) for i in range(200, 500)]
        os.kill(broker.pid, signal.SIGSTOP)  # a hung broker: what is sent now sits unread in its socket
        for exp in second[:150]:
            await pub.send(exp)
        syncing = asyncio.create_task(pub.sync(timeout=60))
        await _until(lambda: pub.resent > 0, 30)  # the unanswered sync has re-sent once
        os.kill(broker.pid, signal.SIGKILL)
        broker.join()
        for exp in second[150:]:  # sent while no broker is up
            await pub.send(exp)
        restarted = spawn_broker(cfg)
        await syncing  # answered by the new broker, after a re-send of what the dead one held
        await pub.sync(timeout=60)
        # the subscriber may miss what the new broker routed before it re-subscribed: it re-subscribes now and
        # reads the log up to then (as the engine's learners do); from then on it receives everything, once
        await sub.resubscribe(timeout=30)
        for exp in ExperienceLogReader(cfg.log_dir):
            if exp.experience_id not in seen:
                seen[exp.experience_id] += 1
        third = [make_experience(i, "m0", completion_tokens=16, text_chars=40) for i in range(500, 520)]
        for exp in third:
            await pub.send(exp)
        await pub.sync(timeout=60)
        await asyncio.wait_for(_until(lambda: len(seen) == 520, 60), 60)
        await _until(lambda: any(x.role == "broker" and x.duplicate_total >= 0 for x in stats), 30)
        receiving.cancel()
        pub.close()
        sub.close()
        restarted.terminate()
        restarted.join(30)
        return seen, stats[-1], pub

    seen, stats, pub = asyncio.run(main())
    log = collections.Counter(e.experience_id for e in ExperienceLogReader(cfg.log_dir))
    expected = {make_experience(i, "m0").experience_id for i in range(520)}
    assert set(log) == expected, f"missing from the log: {sorted(expected - set(log))[:5]}"
    assert max(log.values()) == 1, "an experience was logged twice"
    assert max(seen.values()) == 1, "a subscriber got an experience twice"
    print(f"520 logged once each; {pub.resent} frames re-sent; {stats.duplicate_total} repeats refused")


async def _until(predicate, timeout: float) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


@pytest.mark.parametrize("window, remembered", [(None, range(10)), (8, range(4, 10))])
def test_a_broker_on_an_existing_log_refuses_the_ids_it_holds_and_counts_them(tmp_path, window, remembered):
    """With ``dedupe_ids`` below the log's length only the newest ids are refused, half of it at least
    (here 4 + the 2 of an unfilled generation): memory stays bounded."""
    cfg = _config(tmp_path)
    if window is not None:
        cfg.dedupe_ids = window
    # a re-send is the log's tail (then new ids); an id older than the window is taken as new
    sends = list(range(15)) if window is None else [*remembered, *range(10, 15), 0]
    with ExperienceLogWriter(cfg.log_dir) as log:
        log.append([make_experience(i, "m0", completion_tokens=8, text_chars=20) for i in range(10)])

    async def main() -> tuple[collections.Counter, list[Stats]]:
        broker = spawn_broker(cfg)
        sub = Subscriber(cfg.backend, ["exp.", "stats"], name="learner", lossless=True)
        await sub.ready(timeout=30)
        seen, stats = collections.Counter(), []
        receiving = asyncio.create_task(_receive_all(sub, seen, stats))
        pub = Publisher(cfg.frontend)
        for i in sends:  # a publisher re-sending ids the log holds, then 10..14
            await pub.send(make_experience(i, "m0", completion_tokens=8, text_chars=20))
        await pub.sync(timeout=30)
        await _until(lambda: len(seen) == len(sends) - len(remembered)
                     and any(s.duplicate_total == len(remembered) for s in stats), 30)
        receiving.cancel()
        pub.close()
        sub.close()
        broker.terminate()
        broker.join(30)
        return seen, stats

    seen, stats = asyncio.run(main())
    assert set(seen) == {make_experience(i, "m0").experience_id for i in sends if i not in remembered}
    assert max(seen.values()) == 1 and max(s.duplicate_total for s in stats) == len(remembered)
    log = collections.Counter(e.experience_id for e in ExperienceLogReader(cfg.log_dir))
    assert len(log) == 15 and sum(log.values()) == 10 + len(sends) - len(remembered)


def test_a_sync_answered_after_a_dropped_link_re_sends_what_the_drop_lost(tmp_path):
    """A drop loses the frames ZeroMQ was writing while the later ones, the Sync among them, reach the next broker.

    Large frames to a stopped broker fill the kernel's socket buffers, so the Sync still waits in ZeroMQ's queue
    when the broker is killed: the new broker answers it without ever seeing the first frames. That answer must
    not confirm them (no timed re-send here: ``resend_every_s`` is longer than the test)."""
    cfg = _config(tmp_path)

    async def main() -> Publisher:
        broker = spawn_broker(cfg)
        pub = Publisher(cfg.frontend, max_batch=4, resend_every_s=600)
        await pub.send(make_experience(0, "m0", completion_tokens=8, text_chars=20))
        await pub.sync(timeout=30)  # connected, confirmed
        os.kill(broker.pid, signal.SIGSTOP)
        for i in range(1, 61):  # 15 frames of about 200 KB: more than the socket buffers hold
            await pub.send(make_experience(i, "m0", completion_tokens=8, text_chars=50_000))
        syncing = asyncio.create_task(pub.sync(timeout=60))
        await asyncio.sleep(0.5)  # the Sync is queued behind the frames the kernel holds
        os.kill(broker.pid, signal.SIGKILL)
        broker.join()
        restarted = spawn_broker(cfg)
        await syncing
        pub.close()
        restarted.terminate()
        restarted.join(30)
        return pub

    pub = asyncio.run(main())
    log = collections.Counter(e.experience_id for e in ExperienceLogReader(cfg.log_dir))
    expected = {make_experience(i, "m0").experience_id for i in range(61)}
    assert set(log) == expected, f"confirmed but never logged: {len(expected - set(log))} of 61"
    assert max(log.values()) == 1
    assert pub.resent > 0


def test_a_blocking_publisher_says_when_a_dropped_link_may_have_lost_what_it_sent(tmp_path):
    """BlockingPublisher keeps nothing to send again: after a drop its sync refuses to confirm, in a sentence."""
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)
    pub = BlockingPublisher(cfg.frontend, max_batch=4)
    try:
        pub.send(make_experience(0, "m0", completion_tokens=8, text_chars=20))
        pub.sync(timeout=30)
        pub.send(make_experience(1, "m0", completion_tokens=8, text_chars=20))
        pub.flush()
        broker.kill()
        broker.join()
        broker = spawn_broker(cfg)
        with pytest.raises(ConnectionError, match="dropped since the last sync"):
            pub.sync(timeout=30)
        pub.send(make_experience(2, "m0", completion_tokens=8, text_chars=20))
        pub.sync(timeout=30)  # from here on the link holds: confirmed as usual
    finally:
        pub.close(sync_timeout=None)
        broker.terminate()
        broker.join(30)
