"""SEE subscriber: the async ``Subscriber`` that receives topics from the broker (``exchange.broker``).

A DEALER socket connected to the broker's backend. It announces its topic
prefixes with ``Subscribe``; ``await ready()`` returns once the broker has answered
``Subscribed``, and from then on every message the broker accepts on those topics is
delivered, in the broker's order (this is the ZeroMQ slow-joiner cure). ``lossless=True``
(learners): if this subscriber falls behind by the broker's backlog bound, the broker
stops reading publishers until it catches up. ``lossless=False`` (monitors, taps): the
broker drops what does not fit and counts it in its Stats. Bad frames are decoded into
typed errors, counted in ``rejected`` (last one kept in ``last_error``), never raised.
If nothing arrives for ``resubscribe_s`` the subscription is re-sent (idempotent), so a
restarted broker picks its subscribers up again; ``await resubscribe()`` does it at once and
returns when a broker has confirmed it (a subscriber that knows the broker restarted then
replays the log up to that point: nothing routed before it falls in between).

All socket I/O goes through pyzmq's asyncio layer (never a blocking call on the loop).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

import zmq
import zmq.asyncio

from exchange.codec import DEFAULT_MAX_FRAME_BYTES, DecodeError, Decoder, Encoder
from exchange.link import next_token
from exchange.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Closing,
    Message,
    Subscribe,
    Subscribed,
    Unsubscribe,
)
from exchange.security import ClientKeys, apply_client


class Subscriber:
    """Async subscriber to topic prefixes at the broker backend (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        topics: list[str],
        *,
        name: str | None = None,
        lossless: bool = True,
        max_rate: float = 0.0,  # lossy only: the broker forwards at most this many experiences/s (0: all)
        hwm_frames: int = 64,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        resubscribe_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
        curve: ClientKeys | None = None,  # keys for a CurveZMQ broker (exchange.security)
    ) -> None:
        self.endpoint = endpoint
        self.topics = list(topics)
        self.name = name or f"sub-{os.getpid()}"
        self.lossless = lossless
        if max_rate and lossless:
            raise ValueError("max_rate samples what a subscriber gets: only a lossy subscriber may set it")
        self.max_rate = max_rate
        self.resubscribe_s = resubscribe_s
        self.rejected = 0
        self.last_error: DecodeError | None = None
        self.received = 0
        self._decoder = Decoder(types=(*MESSAGE_TYPES, Subscribed, Closing), max_frame_bytes=max_frame_bytes)
        self._encoder = Encoder()
        self._token = next_token()
        self._ready = False
        self.confirmations = 0  # Subscribed answers received (one per subscription the broker took)
        self._confirmed = asyncio.Event()  # (binds to a loop on first use)
        self.broker_closed = False  # the broker said Closing: everything it had for us has arrived
        self._queue: deque = deque()
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RCVHWM, hwm_frames)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_client(self._sock, curve)
        self._sock.connect(endpoint)
        self._subscribe()

    def _subscribe_frame(self) -> bytes:
        msg = Subscribe(SCHEMA_VERSION, self.name, self.topics, self.lossless, self._token, self.max_rate)
        return Encoder.frame([self._encoder.encode(msg)])

    def _subscribe(self) -> None:
        """First hello, from the constructor (no loop needed; the socket has no waiters yet)."""
        self._send_link_now(self._subscribe_frame())

    def _send_link_now(self, frame: bytes) -> None:
        try:
            zmq.Socket.send(self._sock, frame, zmq.NOBLOCK)
        except zmq.Again:  # a broker away for long fills the queue: skip, retry later
            pass

    @property
    def is_ready(self) -> bool:
        return self._ready

    async def ready(self, timeout: float = 10.0) -> None:
        """Wait until the broker confirms the subscription; raises ``TimeoutError`` with a sentence."""
        try:
            await asyncio.wait_for(self._wait_ready(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no broker confirmed the subscription at {self.endpoint} "
                               f"within {timeout:g} s") from None

    async def _wait_ready(self) -> None:
        while not self._ready:
            await self._fill()

    async def resubscribe(self, timeout: float = 10.0) -> None:
        """Subscribe again now; return once a broker confirmed it (someone must be receiving meanwhile)."""
        self._confirmed.clear()
        self._send_link_now(self._subscribe_frame())
        try:
            await asyncio.wait_for(self._confirmed.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no broker confirmed the subscription at {self.endpoint} "
                               f"within {timeout:g} s") from None

    async def recv(self) -> Message:
        """The next message on the subscribed topics (waits; never raises for bad frames)."""
        while not self._queue:
            await self._fill()
        return self._queue.popleft()

    async def recv_batch(self, max_messages: int = 1 << 30) -> list[Message]:
        """Everything already received (at least one message, at most ``max_messages``); ``[]`` once the
        broker has said Closing and every message before it is taken: nothing more will come."""
        while not self._queue:
            if self.broker_closed:
                return []
            await self._fill()
        n = min(len(self._queue), max_messages)
        return [self._queue.popleft() for _ in range(n)]

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> Message:
        return await self.recv()

    async def _fill(self) -> None:
        """Queue the good messages of every frame already here; if none is, wait for one (re-subscribing while idle).

        Frames already received are read without a future each (a poll and a recv future per frame cost more
        than decoding it): the one await is the wait for the first."""
        if self._take_waiting():
            await asyncio.sleep(0)  # they were here already: still let the loop's other tasks run in between
            return
        while True:
            while not await self._sock.poll(int(self.resubscribe_s * 1000), zmq.POLLIN):
                self._send_link_now(self._subscribe_frame())
            if self._take_waiting():
                return

    def _take_waiting(self, max_frames: int = 16) -> int:
        """Take up to ``max_frames`` frames that have arrived, without waiting; how many there were."""
        for n in range(max_frames):
            try:
                data = zmq.Socket.recv(self._sock, zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return n
            self._take(data)
        return max_frames

    def _take(self, data: bytes) -> None:
        frame = self._decoder.decode_frame(data)
        if frame.errors:
            self.rejected += len(frame.errors)
            self.last_error = frame.errors[-1]
        for msg in frame.messages:
            if type(msg) is Subscribed:
                if msg.token == self._token:
                    self._ready = True
                    self.confirmations += 1
                    self._confirmed.set()
            elif type(msg) is Closing:
                self.broker_closed = True
                self._send_link_now(Encoder.frame([self._encoder.encode(Unsubscribe(SCHEMA_VERSION))]))
            else:
                self._queue.append(msg)
                self.received += 1

    def close(self) -> None:
        """Tell the broker we are leaving (best effort), then close."""
        try:
            zmq.Socket.send(self._sock, Encoder.frame([self._encoder.encode(Unsubscribe(SCHEMA_VERSION))]), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=100)
