"""CurveZMQ on the exchange: a client with an allowed key is served over tcp, one without is refused (and the
refusal is said), a public address without keys is refused up front. Real broker process, real sockets."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from exchange.blocking_publisher import BlockingPublisher
from exchange.broker import BrokerConfig, ConfigError, spawn_broker
from exchange.protocol import Experience
from exchange.publisher import Publisher
from exchange.samples import make_experience
from exchange.security import ClientKeys, KeyRefused, make_keys
from exchange.subscriber import Subscriber

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path):
    """The broker's pair, an allowed client (alice) and a stranger (mallory) whose key is not on the list."""
    make_keys(tmp_path / "broker", "broker")
    make_keys(tmp_path / "alice", "alice")
    make_keys(tmp_path / "mallory", "mallory")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((tmp_path / "alice" / "alice.key").read_bytes())
    server = str(tmp_path / "broker" / "broker.key")
    return {"broker": str(tmp_path / "broker" / "broker.key_secret"), "allowed": str(allowed),
            "alice": ClientKeys(str(tmp_path / "alice" / "alice.key_secret"), server),
            "mallory": ClientKeys(str(tmp_path / "mallory" / "mallory.key_secret"), server)}


def test_an_allowed_key_is_served_and_a_stranger_is_refused(keys, capfd):
    front, back = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    broker = spawn_broker(BrokerConfig(frontend=front, backend=back, curve_secret_key=keys["broker"],
                                       curve_allowed_dir=keys["allowed"], stats_interval_s=0.2))

    async def main() -> tuple[list[str], bool, bool]:
        ctx = zmq.asyncio.Context()  # our own: nothing another test left on the shared instance matters
        alice_sub = Subscriber(back, ["exp."], name="alice-sub", curve=keys["alice"], context=ctx)
        await alice_sub.ready(timeout=30)
        stranger_sub = Subscriber(back, ["exp."], name="mallory-sub", curve=keys["mallory"], context=ctx)
        plain_sub = Subscriber(back, ["exp."], name="plain-sub", context=ctx)  # no keys at all
        refused = []
        for sub in (stranger_sub, plain_sub):
            try:
                await sub.ready(timeout=3)
                refused.append(False)
            except (TimeoutError, asyncio.TimeoutError):
                refused.append(True)
        mallory = Publisher(front, curve=keys["mallory"], context=ctx)
        for i in range(5):
            await mallory.send(make_experience(i, "evil"))
        with pytest.raises(KeyRefused, match="refused this client's CURVE handshake"):  # an error, not a hang
            await asyncio.wait_for(mallory.sync(timeout=60), 30)  # ... long before its own time-out
        # the same, for code without an event loop, on a context of its own too (the process's shared instance
        # holds whatever sockets earlier tests of this xdist worker left on it)
        plain = zmq.Context()
        blocking = BlockingPublisher(front, curve=keys["mallory"], context=plain)
        blocking.send(make_experience(0, "evil"))
        with pytest.raises(KeyRefused):  # its own time-out first: a thread left waiting would hold the loop's close
            await asyncio.wait_for(asyncio.to_thread(blocking.sync, 25), 30)
        blocking.send(make_experience(1, "evil"))  # refused once, refused at once after: no send that can hang
        with pytest.raises(KeyRefused):  # (a blocking send once hung here when the pipe went between poll and send)
            await asyncio.wait_for(asyncio.to_thread(blocking.sync, 25), 30)
        blocking.close(sync_timeout=None)
        plain.term()
        alice = Publisher(front, curve=keys["alice"], context=ctx)
        for i in range(20):
            await alice.send(make_experience(i, "gpt2"))
        await alice.aclose()
        got = []
        while len(got) < 20:
            msg = await asyncio.wait_for(alice_sub.recv(), 30)
            if isinstance(msg, Experience):
                got.append(msg.model)
        mallory.close()
        for sub in (alice_sub, stranger_sub, plain_sub):
            sub.close()
        ctx.destroy(linger=0)
        return got, refused[0], refused[1]

    try:
        got, stranger_refused, plain_refused = asyncio.run(asyncio.wait_for(main(), 100))
    finally:
        broker.terminate()
        broker.join(10)
    assert got == ["gpt2"] * 20  # alice's, and nothing of mallory's
    assert stranger_refused and plain_refused
    assert "refused a client whose CURVE key" in capfd.readouterr().err


def test_a_public_address_needs_keys_and_says_how(tmp_path):
    with pytest.raises(ConfigError, match="curve_secret_key and curve_allowed_dir.*launch.py keys"):
        BrokerConfig(frontend="tcp://0.0.0.0:5999", allow_remote=True).check()
    with pytest.raises(ConfigError, match="go together"):
        BrokerConfig(curve_secret_key=str(tmp_path / "k")).check()
    made = subprocess.run([sys.executable, str(REPO / "launch.py"), "keys", str(tmp_path / "k"), "--name", "node1"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and (tmp_path / "k" / "node1.key").is_file()
    assert (tmp_path / "k" / "node1.key_secret").stat().st_mode & 0o077 == 0  # the secret is private
    again = subprocess.run([sys.executable, str(REPO / "launch.py"), "keys", str(tmp_path / "k"), "--name", "node1"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr
