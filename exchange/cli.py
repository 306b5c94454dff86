"""launch.py's ``exchange`` subcommands: a tap for people on a running broker.

    python launch.py exchange tail  --connect ENDPOINT [--topic PREFIX] [--count N]
    python launch.py exchange stats --connect ENDPOINT [--count N]

ENDPOINT is the broker's backend (where subscribers connect). Both subscribe lossy:
a slow terminal never slows training; what it misses is counted by the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from exchange.protocol import Experience, Message, Stats

READY_TIMEOUT_S = 5.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    exchange = sub.add_parser("exchange", help="watch the shared experience exchange (SEE)")
    cmds = exchange.add_subparsers(dest="exchange_command", metavar="SUBCOMMAND", required=True)
    tail = cmds.add_parser("tail", help="print the live message stream, one line per message")
    tail.add_argument("--connect", required=True, metavar="ENDPOINT", help="broker backend, e.g. tcp://127.0.0.1:5558")
    tail.add_argument("--topic", action="append", default=None, metavar="PREFIX",
                      help="topic prefix to follow, repeatable (default: exp. = all experience)")
    tail.add_argument("--count", type=int, default=0, help="exit after N messages (default: run until Ctrl-C)")
    tail.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for the broker (default: %(default)s)")
    add_curve_args(tail)
    tail.set_defaults(handler=_tail)
    stats = cmds.add_parser("stats", help="print the broker's message rates per topic, once per stats window")
    stats.add_argument("--connect", required=True, metavar="ENDPOINT", help="broker backend, e.g. tcp://127.0.0.1:5558")
    stats.add_argument("--count", type=int, default=0, help="exit after N reports (default: run until Ctrl-C)")
    stats.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for the broker (default: %(default)s)")
    add_curve_args(stats)
    stats.set_defaults(handler=_stats)
    keys = sub.add_parser("keys", help="make a CurveZMQ key pair (NAME.key, NAME.key_secret) for an exchange "
                                       "that listens beyond loopback")
    keys.add_argument("directory", help="where to write the two files")
    keys.add_argument("--name", default="broker", help="file name stem (default: %(default)s); one pair per "
                                                       "broker and per client machine")
    keys.set_defaults(handler=_keys)


def add_curve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--curve-secret", default=None, metavar="FILE",
                        help="this client's NAME.key_secret, for a CurveZMQ broker (a cluster: DIR/cluster.key_secret)")
    parser.add_argument("--curve-server", default=None, metavar="FILE",
                        help="the broker's public NAME.key (a cluster: DIR/cluster.key)")


def curve_keys(args: argparse.Namespace, prog: str = "exchange"):
    """The client's CurveZMQ keys from ``add_curve_args``'s flags, or None; both flags or neither (else
    SystemExit 2 with one line)."""
    from exchange.security import ClientKeys

    if (args.curve_secret is None) != (args.curve_server is None):
        print(f"{prog}: --curve-secret and --curve-server go together", file=sys.stderr)
        raise SystemExit(2)
    return ClientKeys(args.curve_secret, args.curve_server) if args.curve_secret else None


def _keys(args: argparse.Namespace) -> int:
    from exchange.security import make_keys

    try:
        public, secret = make_keys(args.directory, args.name)
    except (FileExistsError, OSError) as exc:
        print(f"keys: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {public} (public: copy it to the broker's curve_allowed_dir, or to clients if this is the "
          f"broker's) and {secret} (secret: keep it on this machine, mode 600)")
    return 0


def format_message(msg: Message) -> str:
    """One human line per message; Experience gets model, prompt id, version, reward, length."""
    if isinstance(msg, Experience):
        n = len(msg.completion_ids) // 4
        mark = "ok" if msg.verified else "--"
        return (f"{msg.model:<16} prompt={msg.prompt_id:<8} sample={msg.sample_index:<3} v={msg.weight_version:<5} "
                f"reward={msg.reward:+.3f} {mark} len={n:<5} {msg.finish_reason}")
    if isinstance(msg, Stats):
        return f"stats {msg.worker_id} role={msg.role} model={msg.model} samples/s={msg.samples_per_s:.1f}"
    fields = " ".join(f"{k}={v}" for k, v in zip(msg.__struct_fields__[1:4], (getattr(msg, f) for f in msg.__struct_fields__[1:4])))
    return f"{type(msg).__name__.lower()} {fields}"


def format_stats(stats: Stats) -> list[str]:
    """A broker Stats as a small table: rate per topic, totals, subscriber backlogs."""
    lines = [f"{stats.worker_id}: {stats.window_s:.1f} s window, accepted {stats.accepted_total}, "
             f"rejected {stats.rejected_total}, dropped {stats.dropped_total}"]
    for topic, rate in sorted(stats.topic_rates.items()):
        lines.append(f"  {topic:<24} {rate:10.1f} msg/s")
    for name, waiting in sorted(stats.subscriber_backlog.items()):
        lines.append(f"  backlog {name:<16} {waiting:8d} messages")
    return lines


async def _follow(endpoint: str, topics: list[str], count: int, timeout: float, show, curve=None) -> int:
    from exchange.security import KeyFileError
    from exchange.subscriber import Subscriber

    try:
        sub = Subscriber(endpoint, topics, name="tap", lossless=False, curve=curve)
    except KeyFileError as exc:
        print(f"exchange: {exc}", file=sys.stderr)
        return 2
    try:
        await sub.ready(timeout)
        shown = 0
        while count <= 0 or shown < count:
            batch = await sub.recv_batch(1 if count > 0 else 1 << 30)
            if not batch:
                print("exchange: the broker closed (its run has ended)", file=sys.stderr)
                return 0
            shown += sum(bool(show(msg)) for msg in batch)
        return 0
    except TimeoutError as exc:
        print(f"exchange: {exc}; is the broker running and is ENDPOINT its backend?", file=sys.stderr)
        return 1
    finally:
        sub.close()


def _run(coro) -> int:
    import zmq

    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        return 0
    except zmq.ZMQError as exc:  # e.g. an ipc path that cannot exist
        print(f"exchange: cannot connect: {exc}", file=sys.stderr)
        return 2


def _check_endpoint(endpoint: str) -> str | None:
    scheme, _, rest = endpoint.partition("://")
    if scheme not in ("tcp", "ipc", "inproc") or not rest:
        return f"exchange: --connect {endpoint!r} is not an endpoint; use tcp://HOST:PORT or ipc://PATH"
    return None


def _tail(args: argparse.Namespace) -> int:
    if err := _check_endpoint(args.connect):
        print(err, file=sys.stderr)
        return 2

    def show(msg: Message) -> bool:
        print(format_message(msg), flush=True)
        return True

    return _run(_follow(args.connect, args.topic or ["exp."], args.count, args.timeout, show, curve_keys(args)))


def _stats(args: argparse.Namespace) -> int:
    if err := _check_endpoint(args.connect):
        print(err, file=sys.stderr)
        return 2

    def show(msg: Message) -> bool:
        if not (isinstance(msg, Stats) and msg.role == "broker"):
            return False
        print("\n".join(format_stats(msg)), flush=True)
        return True

    return _run(_follow(args.connect, ["stats"], args.count, args.timeout, show, curve_keys(args)))
