"""Does the monitor stay live at the exchange's full rate? It may sample; it must say how much it shows.

A broker process and two publisher processes (``benchmarks.exchange``'s realistic experiences:
256-token completions with log-probs) push as fast as they can for ``--seconds``; the monitor's
own subscriber (lossy, the one ``launch.py monitor`` uses) feeds a ``LiveState`` in this process,
whose snapshot is built every 0.5 s as for an open page. Reported: the exchange's rate (the
broker's accepted count), the monitor's (messages aggregated), the share it shows and the
broker's count of what it dropped for the monitor, and liveness: the lag between a snapshot and
the newest experience it holds (median and max over the run). Peer in the same run: the same
subscriber with nothing behind it (decode only), the most any monitor could take in.

    python -m benchmarks.monitor_keepup [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time

from exchange.samples import make_experiences

PUBLISHERS = 2


def _publish(endpoint: str, seconds: float, go) -> None:
    import uvloop

    from exchange.transport import Publisher

    msgs = make_experiences(2000)

    async def main() -> None:
        pub = Publisher(endpoint)
        go.wait()
        end = time.time() + seconds
        while time.time() < end:
            for msg in msgs:
                msg.generated_at = time.time()  # what a generator stamps: the monitor's lag is measured from it
                await pub.send(msg)
        await pub.aclose()

    uvloop.run(main())


async def _watch(backend: str, seconds: float, aggregate: bool) -> dict:
    from pathlib import Path

    from monitor.live import LiveState
    from monitor.sources import Attached

    state = LiveState()
    attached = Attached(backend, Path("."))
    await attached.ready(10)
    if aggregate:
        feeding = asyncio.create_task(attached.feed(state))
    else:
        async def drain() -> None:
            while True:
                state.received += len(await attached.sub.recv_batch(4096))
        feeding = asyncio.create_task(drain())
    lags, started = [], time.time()
    while time.time() - started < seconds + 1:
        await asyncio.sleep(0.5)
        if aggregate:
            state.snapshot()
            if state.received:
                lags.append(time.time() - state.newest_sample_at)
    feeding.cancel()
    attached.close()
    return {"received": state.received, "missed": state.missed, "broker": state.broker, "lags": lags,
            "shown": state.shown()}


def measure(seconds: float, aggregate: bool) -> dict:
    from exchange.broker import BrokerConfig, run_broker

    tmp = tempfile.mkdtemp(prefix="monitor-keepup-")
    ctx = mp.get_context("spawn")
    cfg = BrokerConfig(frontend=f"ipc://{tmp}/front", backend=f"ipc://{tmp}/back", drain_timeout_s=1.0,
                       stats_interval_s=0.5)
    go = ctx.Event()
    broker = ctx.Process(target=run_broker, args=(cfg,))
    pubs = [ctx.Process(target=_publish, args=(cfg.frontend, seconds, go)) for _ in range(PUBLISHERS)]
    try:
        broker.start()
        for p in pubs:
            p.start()
        time.sleep(3)  # publishers build their messages

        async def both() -> dict:
            watching = asyncio.create_task(_watch(cfg.backend, seconds, aggregate))
            await asyncio.sleep(1)
            go.set()
            return await watching

        out = asyncio.run(both())
    finally:
        for p in pubs:
            p.join(30)
        broker.terminate()
        broker.join(10)
        shutil.rmtree(tmp, ignore_errors=True)
    accepted = out["broker"].get("accepted", 0)
    return {"exchange_per_s": round(accepted / seconds), "monitor_per_s": round(out["received"] / seconds),
            "shown": round(out["shown"], 3), "missed": out["missed"],
            "lag_median_s": round(statistics.median(out["lags"]), 2) if out["lags"] else None,
            "lag_max_s": round(max(out["lags"]), 2) if out["lags"] else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    monitor = measure(args.seconds, aggregate=True)
    print(f"monitor: exchange {monitor['exchange_per_s']}/s, aggregated {monitor['monitor_per_s']}/s, "
          f"shows {100 * monitor['shown']:.1f}% (broker dropped {monitor['missed']} for it), "
          f"lag median {monitor['lag_median_s']} s, max {monitor['lag_max_s']} s", flush=True)
    bare = measure(args.seconds, aggregate=False)
    print(f"peer (decode only): took {bare['monitor_per_s']}/s", flush=True)
    print(json.dumps({"monitor": monitor, "decode_only_peer_per_s": bare["monitor_per_s"],
                      "live": monitor["lag_max_s"] is not None and monitor["lag_max_s"] < 2.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
