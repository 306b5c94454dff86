"""Does the monitor keep up with the exchange at its full rate, without slowing it? It may sample; it says how much.

The exchange of ``benchmarks.exchange`` (a publisher sending N realistic experiences as fast as it
can, 256-token completions with log-probs, stamped as a generator stamps them; a broker logging
to disk; a lossless subscriber taking all N, as a learner does) runs in rounds without and with a
monitor attached: a fourth process, at the monitor's niceness, with the monitor's own lossy,
rate-capped subscription feeding a ``LiveState``, whose page snapshot is built and serialised
every 0.5 s as for an open page. Reported: the exchange's rate alone and with the monitor (N /
time from the first send to the N-th message received; medians over rounds, rounds alternate),
their ratio, and for the monitor: the share of the exchange it showed (the broker's count of what
it dropped or sampled out for it) and liveness, the lag between a snapshot and the newest
experience it holds while the exchange runs (median and max).

    python -m benchmarks.monitor_keepup [--messages 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.exchange import _exchange_subscriber, _timed, _uvloop_run
from exchange.samples import make_experiences

RATE_BAR = 0.9  # the exchange with a monitor attached, against the same exchange alone
LIVE_BAR_S = 2.0  # the newest experience a snapshot shows is at most this old while the exchange runs


def _publisher(endpoint: str, n: int, go, results) -> None:
    from exchange.transport import Publisher

    msgs = make_experiences(n)

    async def main() -> None:
        pub = Publisher(endpoint)
        go.wait()
        results.put(("start", time.monotonic(), 0))
        for msg in msgs:
            msg.generated_at = time.time()  # a generator's stamp: the monitor's lag is measured from it
            await pub.send(msg)
        await pub.aclose()

    _uvloop_run(main())


def _monitor(backend: str, stop, out) -> None:
    """The monitor's subscription and aggregation, as ``launch.py monitor`` runs them (niced alike)."""
    import asyncio
    from pathlib import Path

    from monitor.cli import MONITOR_NICE
    from monitor.live import LiveState
    from monitor.sources import Attached

    os.nice(MONITOR_NICE)

    async def main() -> None:
        state = LiveState()
        attached = Attached(backend, Path("."))
        await attached.ready(30)
        out.put(("ready", 0.0, 0.0))
        cpu_at_ready, at_ready = time.process_time(), time.monotonic()
        feeding = asyncio.create_task(attached.feed(state))
        ticks = []
        while not stop.is_set():
            await asyncio.sleep(0.5)
            json.dumps(state.snapshot(), separators=(",", ":"))  # what an open page costs each tick
            ticks.append((time.time(), state.newest_sample_at))
        cpu_share = (time.process_time() - cpu_at_ready) / (time.monotonic() - at_ready)  # over the time it was attached (the exchange runs for part of it)
        await asyncio.sleep(1.5)  # the broker's last Stats (what it dropped for us) arrive
        feeding.cancel()
        attached.close()
        out.put(("done", state.received, state.missed, ticks, cpu_share))

    _uvloop_run(main())


def one_round(n: int, watched: bool) -> dict:
    from exchange.broker import BrokerConfig, run_broker

    tmp = tempfile.mkdtemp(prefix="monitor-keepup-")
    ctx = mp.get_context("spawn")
    cfg = BrokerConfig(frontend=f"ipc://{tmp}/front", backend=f"ipc://{tmp}/back", log_dir=f"{tmp}/log",
                       drain_timeout_s=1.0, stats_interval_s=0.5)
    ready, go, results, stop, watch_out = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=run_broker, args=(cfg,)),
             ctx.Process(target=_exchange_subscriber, args=(cfg.backend, n, ready, results)),
             ctx.Process(target=_publisher, args=(cfg.frontend, n, go, results))]
    if watched:
        procs.append(ctx.Process(target=_monitor, args=(cfg.backend, stop, watch_out)))
    try:
        for p in procs:
            p.start()
        if not ready.wait(60) or (watched and watch_out.get(timeout=60)[0] != "ready"):
            raise RuntimeError("a benchmark subscriber never became ready")
        started = time.time()
        rate = _timed(go, results, n)
        ended = time.time()
        stop.set()
        if not watched:
            return {"exchange_per_s": rate}
        _, received, missed, ticks, cpu_share = watch_out.get(timeout=60)
        lags = [t - newest for t, newest in ticks if started + 1.0 < t <= ended and newest]
        return {"exchange_per_s": rate, "shown": received / max(received + missed, 1), "received": received,
                "missed": missed, "lags": lags, "monitor_cpu_share": cpu_share}
    finally:
        for p in reversed(procs):
            p.join(10) if p is not procs[0] else None
            if p.is_alive():
                p.terminate()
                p.join(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_keepup", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="experiences per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side (they alternate)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    alone, watched = [], []
    for r in range(args.rounds):
        alone.append(one_round(args.messages, watched=False))
        watched.append(one_round(args.messages, watched=True))
        w = watched[-1]
        print(f"round {r + 1}/{args.rounds}: exchange alone {alone[-1]['exchange_per_s']:,.0f}/s, with a monitor "
              f"{w['exchange_per_s']:,.0f}/s; the monitor showed {100 * w['shown']:.1f}% ({w['received']:,} "
              f"aggregated, {w['missed']:,} dropped or sampled out for it), lag max "
              f"{max(w['lags'], default=float('nan')):.2f} s; monitor CPU {100 * w['monitor_cpu_share']:.1f}% of a core",
              flush=True)
    alone_rate = statistics.median(x["exchange_per_s"] for x in alone)
    with_rate = statistics.median(x["exchange_per_s"] for x in watched)
    lags = [lag for w in watched for lag in w["lags"]]
    ratio = with_rate / alone_rate
    live = bool(lags) and max(lags) < LIVE_BAR_S
    print(json.dumps({"messages": args.messages, "rounds": args.rounds, "load_before": round(load_before, 2),
                      "exchange_alone_per_s": round(alone_rate), "exchange_with_monitor_per_s": round(with_rate),
                      "ratio": round(ratio, 3), "ratio_bar": RATE_BAR,
                      "monitor_shown": round(statistics.median(w["shown"] for w in watched), 4),
                      "monitor_aggregated_per_s": round(statistics.median(
                          w["received"] * w["exchange_per_s"] / args.messages for w in watched)),
                      "lag_median_s": round(statistics.median(lags), 2) if lags else None,
                      "lag_max_s": round(max(lags), 2) if lags else None, "lag_bar_s": LIVE_BAR_S,
                      "monitor_cpu_share_of_a_core": round(statistics.median(w["monitor_cpu_share"] for w in watched), 4),
                      "live": live, "passes": ratio >= RATE_BAR and live}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
