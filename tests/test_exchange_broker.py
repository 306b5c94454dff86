"""SEE broker with real processes: nothing lost, drops counted, clean stops, the launch.py tap."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exchange.blocking_publisher import BlockingPublisher
from exchange.broker import BrokerConfig, spawn_broker
from exchange.log import ExperienceLogReader
from exchange.protocol import SCHEMA_VERSION, Control, Experience, Stats
from exchange.publisher import Publisher
from exchange.samples import make_experience
from exchange.subscriber import Subscriber

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, **kw) -> BrokerConfig:
    return BrokerConfig(frontend=f"ipc://{tmp_path}/front", backend=f"ipc://{tmp_path}/back",
                        log_dir=str(tmp_path / "log"), stats_interval_s=0.05, drain_timeout_s=5.0, **kw)


async def _stats_until(sub: Subscriber, done, timeout: float = 60.0) -> Stats:
    """The first broker Stats for which ``done(stats)`` holds."""
    async def wait() -> Stats:
        while True:
            msg = await sub.recv()
            if isinstance(msg, Stats) and msg.role == "broker" and done(msg):
                return msg
    return await asyncio.wait_for(wait(), timeout)


# --- processes (spawn targets) ---

def _publish(endpoint: str, model: str, n: int) -> None:
    async def main() -> None:
        pub = Publisher(endpoint, max_batch=64)
        for i in range(n):
            await pub.send(make_experience(i, model, completion_tokens=32, text_chars=100))
            if i % 97 == 0:
                await asyncio.sleep(0)  # let partial batches out too
        await pub.aclose()

    asyncio.run(main())


def _collect(endpoint: str, name: str, slow: bool, out: str, ready) -> None:
    """Receive experience until a stop Control arrives; write the ids seen, one per line."""
    async def main() -> None:
        sub = Subscriber(endpoint, ["exp.", "ctl"], name=name, lossless=True, hwm_frames=1 if slow else 64)
        await sub.ready()
        ready.set()
        ids = []
        while True:
            batch = await sub.recv_batch(max_messages=40)
            ids += [m.experience_id for m in batch if isinstance(m, Experience)]
            if any(isinstance(m, Control) for m in batch):
                break
            if slow:
                await asyncio.sleep(0.005)  # a learner busy with its optimizer step
        Path(out).write_text("\n".join(ids))
        sub.close()

    asyncio.run(main())


def test_every_experience_arrives_exactly_once_at_each_subscriber_and_in_the_log(tmp_path):
    # small queues so the slow subscriber forces backlog and back-pressure on the publishers
    cfg = _config(tmp_path, hwm_frames=2, backlog_messages=200)
    broker = spawn_broker(cfg)
    ctx = mp.get_context("spawn")
    models, per_model = ("m0", "m1", "m2"), 700
    expected = {make_experience(i, m).experience_id for m in models for i in range(per_model)}
    subs = []
    for name, slow in (("fast", False), ("slow", True)):
        ready = ctx.Event()
        proc = ctx.Process(target=_collect, args=(cfg.backend, name, slow, str(tmp_path / name), ready))
        proc.start()
        subs.append((name, proc, ready))

    async def drive() -> Stats:
        watch = Subscriber(cfg.backend, ["stats"], name="watch", lossless=False)
        await watch.ready()
        for _, _, ready in subs:
            assert await asyncio.to_thread(ready.wait, 60)
        pubs = [ctx.Process(target=_publish, args=(cfg.frontend, m, per_model)) for m in models]
        for p in pubs:
            p.start()
        await _stats_until(watch, lambda s: s.accepted_total >= len(expected))
        stop = Publisher(cfg.frontend)
        await stop.send(Control(SCHEMA_VERSION, "stop", reason="test done"))
        await stop.aclose()
        final = await _stats_until(watch, lambda s: s.accepted_total == len(expected) + 1)
        for p in pubs:
            await asyncio.to_thread(p.join, 30)
            assert p.exitcode == 0
        watch.close()
        return final

    final = asyncio.run(drive())
    broker.join(30)
    assert broker.exitcode == 0
    assert final.dropped_total == 0 and final.rejected_total == 0
    for name, proc, _ in subs:
        proc.join(30)
        assert proc.exitcode == 0, f"subscriber {name} exit code {proc.exitcode}"
        seen = (tmp_path / name).read_text().split("\n")
        assert collections.Counter(seen).most_common(1)[0][1] == 1, f"{name} got a duplicate"
        assert set(seen) == expected, f"{name} lost {len(expected - set(seen))}"
    logged = [e.experience_id for e in ExperienceLogReader(cfg.log_dir)]
    assert len(logged) == len(expected) and set(logged) == expected


def test_a_lossy_subscriber_that_stalls_is_visible_and_its_drops_are_counted(tmp_path):
    cfg = _config(tmp_path, hwm_frames=1, backlog_messages=100)
    broker = spawn_broker(cfg)
    n = 1500

    async def drive() -> tuple[int, Stats, int]:
        watch = Subscriber(cfg.backend, ["stats"], name="watch", lossless=False)
        stalled = Subscriber(cfg.backend, ["exp."], name="tap", lossless=False, hwm_frames=1)
        await watch.ready()
        await stalled.ready()
        pub = Publisher(cfg.frontend, max_batch=16)
        for i in range(n):
            await pub.send(make_experience(i, "m0", completion_tokens=32, text_chars=100))
        await pub.flush()
        seen_backlog = await _stats_until(watch, lambda s: s.accepted_total == n)
        await pub.send(Control(SCHEMA_VERSION, "stop"))
        await pub.aclose()
        final = await _stats_until(watch, lambda s: s.accepted_total == n + 1)
        received = 0
        while received < n - final.dropped_total:  # everything not dropped still arrives
            received += len(await asyncio.wait_for(stalled.recv_batch(), 30))
        watch.close()
        stalled.close()
        return received, final, seen_backlog.subscriber_backlog["tap"]

    received, final, backlog = asyncio.run(drive())
    broker.join(30)
    assert broker.exitcode == 0
    assert final.dropped_total > 0 and backlog > 0
    assert received + final.dropped_total == n


def test_a_rate_capped_subscriber_gets_a_counted_sample_and_every_stats_message(tmp_path):
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)
    n, rate = 3000, 200.0

    async def drive() -> tuple[list, int, Stats, float]:
        capped = Subscriber(cfg.backend, ["exp.", "stats"], name="monitor", lossless=False, max_rate=rate)
        learner = Subscriber(cfg.backend, ["exp."], name="learner")
        await capped.ready()
        await learner.ready()
        started = asyncio.get_running_loop().time()
        pub = Publisher(cfg.frontend, max_batch=16)
        for i in range(n):
            await pub.send(make_experience(i, ("m0", "m1")[i % 2], completion_tokens=32, text_chars=100))
        await pub.flush()
        elapsed = asyncio.get_running_loop().time() - started
        got, taken, final = [], 0, None
        while taken < n:  # the lossless learner takes everything
            taken += len(await asyncio.wait_for(learner.recv_batch(), 30))
        while final is None:
            for msg in await asyncio.wait_for(capped.recv_batch(), 30):
                if isinstance(msg, Experience):
                    got.append(msg)
                elif isinstance(msg, Stats) and msg.role == "broker" and msg.accepted_total == n \
                        and len(got) + msg.subscriber_dropped.get("monitor", 0) == n:
                    final = msg
        await pub.send(Control(SCHEMA_VERSION, "stop"))
        await pub.aclose()
        capped.close()
        learner.close()
        return got, taken, final, elapsed

    got, taken, final, elapsed = asyncio.run(drive())
    broker.join(30)
    assert broker.exitcode == 0
    assert taken == n  # the cap is the monitor's alone
    assert 0 < len(got) < n and len(got) <= rate * (elapsed + 1) + 16  # a second's burst and one frame of debt
    assert len(got) + final.subscriber_dropped["monitor"] == n  # every experience it did not get is counted
    assert {e.model for e in got} == {"m0", "m1"}
    with pytest.raises(ValueError, match="lossy"):
        Subscriber(cfg.backend, ["exp."], max_rate=10.0)


def test_a_rate_capped_subscriber_over_its_rate_still_gets_the_other_messages_of_a_mixed_frame(tmp_path):
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)

    def exp(i: int) -> Experience:
        return make_experience(i, ("m0", "m1")[i % 2], completion_tokens=8, text_chars=20)

    async def drive() -> tuple[list, list, Stats]:
        capped = Subscriber(cfg.backend, ["exp.", "stats"], name="monitor", lossless=False, max_rate=1.0)
        await capped.ready()
        pub = Publisher(cfg.frontend)
        for i in range(4):  # one frame inside the first second's allowance ...
            await pub.send(exp(i))
        await pub.flush()
        for i in range(4, 8):  # ... then one over it, experiences of both models with a worker's Stats
            await pub.send(exp(i))
        await pub.send(Stats(SCHEMA_VERSION, "w9", "generator", "m0", 0.0, 1.0))
        await pub.flush()
        got, stats, final = [], [], None
        while final is None:
            for msg in await asyncio.wait_for(capped.recv_batch(), 30):
                if isinstance(msg, Experience):
                    got.append(msg.experience_id)
                elif msg.worker_id == "w9":
                    stats.append(msg)
                elif msg.role == "broker" and msg.accepted_total == 9 and msg.subscriber_dropped.get("monitor") == 4:
                    final = msg
        await pub.send(Control(SCHEMA_VERSION, "stop"))
        await pub.aclose()
        capped.close()
        return got, stats, final

    got, stats, final = asyncio.run(drive())
    broker.join(30)
    assert broker.exitcode == 0
    assert got == [exp(i).experience_id for i in range(4)]  # the first frame whole, in order
    assert len(stats) == 1  # the Stats of the frame over the rate went through ...
    assert final.subscriber_dropped["monitor"] == 4  # ... its experiences were dropped for the monitor, counted


def test_sigterm_stops_the_broker_cleanly_and_keeps_the_log(tmp_path):
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)

    async def drive() -> None:
        watch = Subscriber(cfg.backend, ["stats"], lossless=False)
        await watch.ready()
        pub = BlockingPublisher(cfg.frontend, max_batch=16)  # the loop-less flavour, from a thread
        await asyncio.to_thread(lambda: [pub.send(make_experience(i)) for i in range(50)] and pub.close())
        await _stats_until(watch, lambda s: s.accepted_total == 50)
        watch.close()

    asyncio.run(drive())
    broker.terminate()
    broker.join(30)
    assert broker.exitcode == 0
    assert [e.prompt_id for e in ExperienceLogReader(cfg.log_dir)] == [make_experience(i).prompt_id for i in range(50)]


def test_broker_command_line_refuses_a_public_address_in_one_sentence():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    help_ = subprocess.run([sys.executable, "-m", "exchange.broker", "--help"], capture_output=True, text=True, env=env)
    assert help_.returncode == 0 and "--frontend" in help_.stdout
    bad = subprocess.run([sys.executable, "-m", "exchange.broker", "--frontend", "tcp://0.0.0.0:5999"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert bad.returncode == 2 and "allow_remote" in bad.stderr and "Traceback" not in bad.stderr


def _launch(*args: str, timeout: float = 60) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), "exchange", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_tail_and_stats_commands_print_the_live_stream(tmp_path):
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)
    tail = _launch("tail", "--connect", cfg.backend, "--count", "5")
    stats = None

    async def feed() -> None:
        nonlocal stats
        pub = Publisher(cfg.frontend)
        i = 0
        while stats is None or stats.poll() is None:
            if stats is None and tail.poll() is not None:  # traffic is flowing: now ask for rates
                stats = _launch("stats", "--connect", cfg.backend, "--count", "2")
            await pub.send(make_experience(i, "qwen-tiny", completion_tokens=7))
            i += 1
            await asyncio.sleep(0.01)
        await pub.send(Control(SCHEMA_VERSION, "stop"))
        await pub.aclose()

    asyncio.run(asyncio.wait_for(feed(), 60))
    broker.join(30)
    out, err = tail.communicate()
    assert tail.returncode == 0, err
    lines = out.strip().split("\n")
    assert len(lines) == 5 and all(line.startswith("qwen-tiny") and "len=7" in line for line in lines)
    out, err = stats.communicate()
    assert stats.returncode == 0, err
    assert "exp.qwen-tiny" in out and "msg/s" in out


def test_a_broker_that_stops_ends_recv_batch_and_the_tap(tmp_path):
    """After the broker's Closing, ``recv_batch`` hands over what came before it, then ``[]`` (never a hang);
    ``exchange tail`` following the stream says the broker closed and exits 0."""
    cfg = _config(tmp_path)
    broker = spawn_broker(cfg)
    tail = _launch("tail", "--connect", cfg.backend)

    async def drive() -> list:
        sub = Subscriber(cfg.backend, ["exp."], name="last", lossless=True)
        await sub.ready()
        pub = Publisher(cfg.frontend)
        i = 0
        while i < 3 or not _said(tail):  # the tap shows traffic: it is following the stream
            await pub.send(make_experience(i, "gpt2"))
            i += 1
            await asyncio.sleep(0.05)
        await pub.send(Control(SCHEMA_VERSION, "stop"))
        await pub.aclose()
        got = []
        while batch := await asyncio.wait_for(sub.recv_batch(), 30):
            got += batch
        assert await asyncio.wait_for(sub.recv_batch(), 5) == []  # and again: it stays ended
        sub.close()
        return got

    got = asyncio.run(asyncio.wait_for(drive(), 90))
    broker.join(30)
    assert [e.prompt_id for e in got] == [make_experience(i).prompt_id for i in range(len(got))] and len(got) >= 3
    out, err = tail.communicate(timeout=30)
    assert tail.returncode == 0 and "the broker closed" in err and "Traceback" not in err, err


def _said(proc: subprocess.Popen) -> bool:
    """Whether the process has printed a line (reads it; never waits for one)."""
    import select

    return bool(select.select([proc.stdout], [], [], 0)[0]) and bool(proc.stdout.readline())


def test_tail_without_a_broker_says_so_and_exits():
    tail = _launch("tail", "--connect", "tcp://127.0.0.1:1", "--timeout", "0.5")
    out, err = tail.communicate(timeout=30)
    assert tail.returncode == 1 and "no broker" in err and "Traceback" not in err
    bad = _launch("tail", "--connect", "localhost:5558")
    out, err = bad.communicate(timeout=30)
    assert bad.returncode == 2 and "not an endpoint" in err
