"""What ZeroMQ saw of a client socket's one connection to the broker: drops and CURVE refusals.

ZeroMQ hides reconnects, and that is mostly what we want. Two things must not stay hidden:

- A drop. Frames ZeroMQ had already taken off the socket's queue when the connection broke are
  gone, while the later ones go out over the next connection, in order. So a broker's answer to
  a ``Sync`` proves that everything sent before it arrived only if the link never dropped since
  the first of those frames left. ``drops`` counts the drops seen so far.
- A refusal of this client's CURVE key (ZAP said no): without it a wrong key looks like a hang.
  Other handshake failures may be passing (a broker restarting), and a wrong *broker* key leaves
  nothing to see (the broker cannot read our hello): its syncs time out.

Also what every client of the broker shares (``exchange.publisher``, ``exchange.blocking_publisher``,
``exchange.subscriber``): the tokens that pair a ``Sync`` or ``Subscribe`` with the broker's answer, and
how often a client waiting on the broker looks for a refusal; and ``recv_multipart`` for any CURVE socket of the
project's (the engine's plane and weight relay too).
"""

from __future__ import annotations

import itertools
import os

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from exchange.security import ClientKeys, KeyRefused, apply_client

REFUSAL_CHECK_S = 0.2  # how often a CURVE client waiting on the broker looks for a refusal of its key
_watch_ids = itertools.count()
_tokens = itertools.count(int.from_bytes(os.urandom(3), "little") << 20)


def next_token() -> int:
    """A token for a ``Sync`` or ``Subscribe`` (one count for every client of this process, from a random start)."""
    return next(_tokens)


class LinkWatch:
    """Reads a socket's monitor events without blocking; attach before ``connect`` (one per socket)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, *, curve: bool = False) -> None:
        self.endpoint = endpoint
        self.drops = 0
        self.refused = False  # sticks: a refused key stays refused
        mask = zmq.EVENT_DISCONNECTED | (zmq.EVENT_HANDSHAKE_FAILED_AUTH if curve else 0)
        address = f"inproc://link-watch-{next(_watch_ids)}"
        sock.monitor(address, mask)
        # a plain (blocking-API) socket on the same context: read with NOBLOCK, never awaited
        self._events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._events.connect(address)

    def update(self) -> LinkWatch:
        """Take in every event that has arrived; never blocks."""
        while True:
            try:
                parts = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self
            event = parse_monitor_message(parts)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.drops += 1
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = True

    def raise_if_refused(self) -> None:
        """Raises ``KeyRefused`` once the broker has refused a handshake of this client; never blocks."""
        if self.update().refused:
            raise KeyRefused(f"the broker at {self.endpoint} refused this client's CURVE handshake: its public key "
                             "is not in the broker's allow-list (copy its NAME.key there; see `python launch.py keys`)")

    def close(self) -> None:
        self._events.close(linger=0)


def dealer_socket(context: zmq.Context, endpoint: str, hwm_frames: int,
                  curve: ClientKeys | None) -> tuple[zmq.Socket, LinkWatch]:
    """A publisher's DEALER socket to the broker at ``endpoint``, connected, with its ``LinkWatch`` attached first
    (drops and, with CURVE, refusals); sends wait at ``hwm_frames``, a close drops what is unsent."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, hwm_frames)
    sock.setsockopt(zmq.LINGER, 0)
    apply_client(sock, curve)
    link = LinkWatch(sock, endpoint, curve=curve is not None)
    sock.connect(endpoint)
    return sock, link


async def recv_multipart(sock: zmq.asyncio.Socket, copy: bool = True) -> list:
    """``sock.recv_multipart``, again when ZeroMQ said a message was ready and then had none: with CurveZMQ a
    connection that goes away meanwhile (a refused or departed peer) does that, and it is no error of ours."""
    while True:
        try:
            return await sock.recv_multipart(copy=copy)
        except zmq.Again:
            continue
