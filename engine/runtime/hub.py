"""The SEE hub of a run: the broker process plus the coordinator's own publisher and subscriber.

A broker that dies is started again on the same endpoints and log (``restart_broker``).

ipc endpoints in a private socket directory, the experience log in the run dir, and a
lossy subscription for the coordinator (it must never slow the workers down).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from engine.runtime import actors
from exchange.broker_config import BrokerConfig
from exchange.broker_loop import Broker
from exchange.protocol import SCHEMA_VERSION, Control
from exchange.publisher import Publisher
from exchange.security import ClientKeys
from exchange.subscriber import Subscriber


def broker_entry(payload: bytes) -> int:
    """Broker process: stops on ``Control(stop)`` from the coordinator (signals are the coordinator's to handle)."""
    Broker(msgspec.msgpack.decode(payload, type=BrokerConfig)).run()
    return 0


async def stop_broker(pub: Publisher) -> None:
    """Ask the broker to stop: it forwards what it holds, closes its log and exits."""
    await pub.send(Control(schema=SCHEMA_VERSION, command="stop", reason="end of run"))


@dataclass
class Hub:
    actor: actors.Actor  # the broker process
    broker_in: str  # publishers connect here
    broker_out: str  # subscribers connect here
    pub: Publisher
    sub: Subscriber
    config: BrokerConfig
    curve: ClientKeys | None = None  # a cluster's keys: the broker is a CurveZMQ server, every client uses them

    def endpoints(self) -> dict:
        """endpoints.json: where the exchange is; with a cluster's keys, the files a client reads (paths only)."""
        keys = {"curve_secret": self.curve.secret_file, "curve_server": self.curve.server_public_file} if self.curve else {}
        return {"publish": self.broker_in, "subscribe": self.broker_out, **keys}

    def tail_command(self) -> str:
        """How a person watches the experience stream of this broker."""
        keys = f" --curve-secret {self.curve.secret_file} --curve-server {self.curve.server_public_file}" if self.curve else ""
        return f"python launch.py exchange tail --connect {self.broker_out}{keys}"


def spawn_broker(config: BrokerConfig) -> actors.Actor:
    return actors.spawn("broker", "engine.runtime.hub:broker_entry", msgspec.msgpack.encode(config))


async def restart_broker(hub: Hub, timeout_s: float) -> actors.Actor:
    """A new broker on the dead one's endpoints and log (its torn tail cut); returns once it serves subscribers.
    Publishers reconnect on their own and re-send what was never confirmed."""
    hub.actor = spawn_broker(hub.config)
    probe = Subscriber(hub.broker_out, ["stats"], name="coordinator-probe", lossless=False, curve=hub.curve)
    try:
        await probe.ready(timeout=timeout_s)
    finally:
        probe.close()
    return hub.actor


async def start_hub(run_dir: Path, sock_dir: Path, topics: list[str], name: str, timeout_s: float,
                    ends: tuple[str, str] | None = None, curve: ClientKeys | None = None) -> Hub:
    """Spawn the broker and wait until the coordinator's own subscription is live; on the tcp ``ends`` given
    (in, out: a cluster's node 0, ``engine.cluster.node.tcp``; CurveZMQ with the cluster's key pair ``curve``,
    the broker's own too), else on ipc endpoints in ``sock_dir``."""
    broker_in, broker_out = ends or (f"ipc://{sock_dir}/in", f"ipc://{sock_dir}/out")
    config = BrokerConfig(frontend=broker_in, backend=broker_out, log_dir=str(run_dir / "experience_log"),
                          name="broker", run_id=run_dir.name, allow_remote=ends is not None,
                          allow_plaintext=ends is not None and curve is None,  # cluster.from_env refused it unless private
                          curve_secret_key=curve.secret_file if curve else None,
                          curve_allowed_dir=str(Path(curve.secret_file).parent) if curve else None)
    actor = spawn_broker(config)
    pub = Publisher(broker_in, curve=curve)
    sub = Subscriber(broker_out, topics, name=name, lossless=False, curve=curve)
    await sub.ready(timeout=timeout_s)
    return Hub(actor=actor, broker_in=broker_in, broker_out=broker_out, pub=pub, sub=sub, config=config, curve=curve)
