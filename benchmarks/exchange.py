"""SEE throughput: Experience through publisher -> broker -> subscriber vs. bare pyzmq PUSH/PULL.

    python -m benchmarks.exchange [--quick] [--messages N] [--rounds R] [--no-log]

Exchange path (3 processes): an asyncio/uvloop ``Publisher`` sends N realistic
Experience messages (256-token completion with log-probs, 128-token prompt, ~1 KB
text) to a broker process (decode, validate, log to disk, route), which forwards to
an asyncio/uvloop ``Subscriber`` in a third process that decodes and validates again.

Peers, measured in the same run, alternating with the exchange rounds, carrying the
same encoded bytes between two processes, one ZeroMQ message per Experience:
- ``raw_zmq_per_s``: bare zmq.asyncio PUSH/PULL under uvloop (an asyncio program's
  ordinary way to move messages: the peer ``ratio`` is defined against);
- ``raw_zmq_sync_per_s``: bare blocking PUSH/PULL loops (no event loop; the ceiling).

Rate = N / (time from the first send to the N-th message received), clocks are
CLOCK_MONOTONIC, shared by processes. Median over rounds. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

from exchange.samples import make_experiences


def _uvloop_run(coro):
    import uvloop

    return uvloop.run(coro)


# --- exchange path ---

def _exchange_subscriber(endpoint: str, n: int, ready, results) -> None:
    from exchange.subscriber import Subscriber

    async def main() -> None:
        sub = Subscriber(endpoint, ["exp."], name="bench")
        await sub.ready()
        ready.set()
        got = 0
        while got < n:
            got += len(await sub.recv_batch())
        results.put(("done", time.monotonic(), sub.rejected))
        sub.close()

    _uvloop_run(main())


def _exchange_publisher(endpoint: str, n: int, go, results) -> None:
    from exchange.publisher import Publisher

    msgs = make_experiences(n)

    async def main() -> None:
        pub = Publisher(endpoint)
        go.wait()
        results.put(("start", time.monotonic(), 0))
        for msg in msgs:
            await pub.send(msg)
        await pub.aclose()

    _uvloop_run(main())


def run_exchange(n: int, log: bool) -> float:
    from exchange.broker import BrokerConfig, run_broker

    tmp = tempfile.mkdtemp(prefix="see-bench-")
    ctx = mp.get_context("spawn")
    cfg = BrokerConfig(frontend=f"ipc://{tmp}/front", backend=f"ipc://{tmp}/back",
                       log_dir=f"{tmp}/log" if log else None, drain_timeout_s=1.0)
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    broker = ctx.Process(target=run_broker, args=(cfg,))
    sub = ctx.Process(target=_exchange_subscriber, args=(cfg.backend, n, ready, results))
    pub = ctx.Process(target=_exchange_publisher, args=(cfg.frontend, n, go, results))
    try:
        broker.start()
        sub.start()
        pub.start()
        if not ready.wait(60):
            raise RuntimeError("the benchmark subscriber never became ready")
        return _timed(go, results, n)
    finally:
        for p in (pub, sub, broker):
            p.join(10) if p is not broker else None
            if p.is_alive():
                p.terminate()
                p.join(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _timed(go, results, n: int) -> float:
    time.sleep(0.5)  # let the publisher finish building its messages
    go.set()
    stamps = dict((kind, (t, extra)) for kind, t, extra in (results.get(timeout=300) for _ in range(2)))
    if stamps["done"][1]:
        raise RuntimeError(f"subscriber rejected {stamps['done'][1]} benchmark messages")
    return n / (stamps["done"][0] - stamps["start"][0])


# --- bare pyzmq peers ---

def _raw_pull(endpoint: str, n: int, use_asyncio: bool, ready, results) -> None:
    import zmq
    import zmq.asyncio

    if not use_asyncio:
        sock = zmq.Context().socket(zmq.PULL)
        sock.bind(endpoint)
        ready.set()
        for _ in range(n):
            sock.recv()
        results.put(("done", time.monotonic(), 0))
        return

    async def main() -> None:
        sock = zmq.asyncio.Context().socket(zmq.PULL)
        sock.bind(endpoint)
        ready.set()
        for _ in range(n):
            await sock.recv()
        results.put(("done", time.monotonic(), 0))

    _uvloop_run(main())


def _raw_push(endpoint: str, n: int, use_asyncio: bool, go, results) -> None:
    import msgspec
    import zmq
    import zmq.asyncio

    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(m) for m in make_experiences(n)]
    if not use_asyncio:
        sock = zmq.Context().socket(zmq.PUSH)
        sock.connect(endpoint)
        go.wait()
        results.put(("start", time.monotonic(), 0))
        for p in payloads:
            sock.send(p)
        sock.close(linger=-1)
        return

    async def main() -> None:
        sock = zmq.asyncio.Context().socket(zmq.PUSH)
        sock.connect(endpoint)
        go.wait()
        results.put(("start", time.monotonic(), 0))
        for p in payloads:
            await sock.send(p)
        sock.close(linger=-1)

    _uvloop_run(main())


def run_raw(n: int, use_asyncio: bool) -> float:
    tmp = tempfile.mkdtemp(prefix="see-bench-raw-")
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    endpoint = f"ipc://{tmp}/raw"
    pull = ctx.Process(target=_raw_pull, args=(endpoint, n, use_asyncio, ready, results))
    push = ctx.Process(target=_raw_push, args=(endpoint, n, use_asyncio, go, results))
    try:
        pull.start()
        push.start()
        if not ready.wait(60):
            raise RuntimeError("the raw PULL process never became ready")
        return _timed(go, results, n)
    finally:
        for p in (push, pull):
            p.join(10)
            if p.is_alive():
                p.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and rounds (under 30 s)")
    parser.add_argument("--messages", type=int, default=None, help="experiences per round (default 100000, quick 30000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per path (default 3, quick 1)")
    parser.add_argument("--no-log", action="store_true", help="broker without the experience log")
    args = parser.parse_args(argv)
    n = args.messages or (30_000 if args.quick else 100_000)
    rounds = args.rounds or (1 if args.quick else 3)
    load_before = os.getloadavg()[0]
    exchange, raw_async, raw_sync = [], [], []
    for r in range(rounds):
        raw_async.append(run_raw(n, use_asyncio=True))
        exchange.append(run_exchange(n, log=not args.no_log))
        raw_sync.append(run_raw(n, use_asyncio=False))
        print(f"round {r + 1}/{rounds}: exchange {exchange[-1]:.0f}/s, raw asyncio {raw_async[-1]:.0f}/s, "
              f"raw sync {raw_sync[-1]:.0f}/s", flush=True)
    exp_rate, async_rate, sync_rate = (statistics.median(x) for x in (exchange, raw_async, raw_sync))
    result = {
        "benchmark": "exchange",
        "messages": n,
        "rounds": rounds,
        "message_bytes": len(__import__("msgspec").msgpack.encode(make_experiences(1)[0])),
        "log": not args.no_log,
        "experiences_per_s": round(exp_rate),
        "raw_zmq_per_s": round(async_rate),
        "raw_zmq_sync_per_s": round(sync_rate),
        "ratio": round(exp_rate / async_rate, 3),
        "ratio_vs_sync": round(exp_rate / sync_rate, 3),
        "limit_ratio": 0.8,
        "limit_experiences_per_s": 20000,
        "passed": exp_rate / async_rate >= 0.8 and exp_rate >= 20000,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
