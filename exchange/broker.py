"""The SEE broker as a process: ``run_broker`` (blocking, until stopped), ``spawn_broker`` (in a fresh
spawned process) and the command line, ``python -m exchange.broker``.

The hub itself, its loop and its invariants, is ``exchange.broker_loop.Broker``; its settings are
``BrokerConfig`` (``exchange.broker_config``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import threading

import zmq

from exchange.broker_config import BrokerConfig, ConfigError
from exchange.broker_loop import Broker
from exchange.security import KeyFileError


def run_broker(config: BrokerConfig) -> None:
    """Run the hub until stopped (blocking). Installs SIGTERM/SIGINT handlers when on the main thread."""
    broker = Broker(config)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, broker.request_stop)
        signal.signal(signal.SIGINT, broker.request_stop)
    broker.run()


def spawn_broker(config: BrokerConfig) -> multiprocessing.process.BaseProcess:
    """Check ``config`` here (``ConfigError`` in the caller), then run the hub in a fresh spawned process.

    Stop it with a ``Control(command="stop")`` or ``proc.terminate()`` (SIGTERM); both exit 0.
    """
    config.check()
    proc = multiprocessing.get_context("spawn").Process(target=run_broker, args=(config,), name=f"see-{config.name}")
    proc.start()
    return proc


def main(argv: list[str] | None = None) -> int:
    defaults = BrokerConfig()
    parser = argparse.ArgumentParser(prog="python -m exchange.broker",
                                     description="Run the SEE hub (shared experience exchange broker).")
    parser.add_argument("--frontend", default=defaults.frontend,
                        help="endpoint publishers connect to (default: %(default)s)")
    parser.add_argument("--backend", default=defaults.backend,
                        help="endpoint subscribers connect to (default: %(default)s)")
    parser.add_argument("--log-dir", default=None, help="experience log directory (default: no log)")
    parser.add_argument("--backlog-messages", type=int, default=defaults.backlog_messages,
                        help="per-subscriber backlog bound (default: %(default)s)")
    parser.add_argument("--stats-interval", type=float, default=defaults.stats_interval_s,
                        help="seconds between Stats (default: %(default)s)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow binding non-loopback tcp addresses "
                             "(needs --curve-secret-key and --curve-allowed-dir)")
    parser.add_argument("--curve-secret-key", default=None, metavar="FILE",
                        help="the broker's NAME.key_secret (python launch.py keys DIR): CurveZMQ on")
    parser.add_argument("--curve-allowed-dir", default=None, metavar="DIR",
                        help="directory of the client public keys (*.key) the broker lets in")
    args = parser.parse_args(argv)
    config = BrokerConfig(frontend=args.frontend, backend=args.backend, log_dir=args.log_dir,
                          backlog_messages=args.backlog_messages, stats_interval_s=args.stats_interval,
                          allow_remote=args.allow_remote, curve_secret_key=args.curve_secret_key,
                          curve_allowed_dir=args.curve_allowed_dir)
    try:
        run_broker(config)
    except (ConfigError, KeyFileError, zmq.ZMQError, OSError) as exc:
        print(f"exchange broker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["BrokerConfig", "ConfigError", "run_broker", "spawn_broker", "main"]
