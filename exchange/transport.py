"""SEE transport: async Publisher and Subscriber that talk to the broker (``exchange.broker``).

Publisher: a DEALER socket connected to the broker's frontend (a ROUTER). ``await send(msg)``
encodes and validates at once (your bad data raises here, typed), then buffers; the buffer
goes out as one frame when it holds ``max_batch`` messages or ``max_batch_bytes``, or at the
next turn of the event loop, whichever comes first. So a burst of sends costs one socket
operation per batch, and a lone send waits at most one loop turn.
Blocks: when the broker is not reading (its own back-pressure, or it is not up yet) the
socket queue fills to ``hwm_frames`` and ``send``/``flush`` wait. Never drops.
Confirms: ``await sync()`` returns once the broker has processed (logged, routed or counted
as rejected) everything sent before it; ``aclose()`` syncs before closing, so a process
that exits after ``aclose()`` has lost nothing (ZeroMQ alone would drop its queue on exit).
Survives a broker restart: the frames sent since the last confirmed sync are kept (up to
``keep_unconfirmed_bytes``); a sync not answered within ``resend_every_s`` sends them again
(ZeroMQ has reconnected to the new broker by then, which refuses ids its log holds already).
An answer counts only if the link never dropped since those frames left (``exchange.link``):
a drop loses the frames ZeroMQ was writing, and the Sync behind them may still get through.

Subscriber: a DEALER socket connected to the broker's backend. It announces its topic
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
import collections
import itertools
import os
import time
from collections import deque

import zmq
import zmq.asyncio

from exchange.codec import DEFAULT_MAX_FRAME_BYTES, DecodeError, Decoder, Encoder
from exchange.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Closing,
    Message,
    Subscribe,
    Subscribed,
    Sync,
    Synced,
    Unsubscribe,
)
from exchange.link import LinkWatch
from exchange.security import ClientKeys, apply_client

REFUSAL_CHECK_S = 0.2  # how often a CURVE client waiting on the broker looks for a refusal of its key
_tokens = itertools.count(int.from_bytes(os.urandom(3), "little") << 20)


class Backpressure(RuntimeError):
    """send_nowait found the publisher's buffer full; ``await pub.flush()`` and retry."""


class Publisher:
    """Async publisher of typed messages to the broker frontend (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_batch: int = 256,  # messages per frame; amortises the per-frame event-loop cost
        max_batch_bytes: int = 1 << 20,
        hwm_frames: int = 64,  # frames queued in ZeroMQ before send waits
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        context: zmq.asyncio.Context | None = None,
        curve: ClientKeys | None = None,  # keys for a CurveZMQ broker (exchange.security)
        resend_every_s: float = 5.0,  # a sync unanswered this long re-sends what is unconfirmed
        keep_unconfirmed_bytes: int = 16 << 20,  # beyond this the oldest unconfirmed frames are forgotten
    ) -> None:
        self.endpoint = endpoint
        self.resend_every_s = resend_every_s
        self.keep_unconfirmed_bytes = keep_unconfirmed_bytes
        # frames sent since the last confirmed sync, each with the link's drop count when it left; the first is
        # frame number _first_unconfirmed of this publisher
        self._unconfirmed: collections.deque[tuple[bytes, int]] = collections.deque()
        self._first_unconfirmed = 0
        self._unconfirmed_bytes = 0
        self.resent = 0  # frames sent again because a sync went unanswered
        self.unprotected = 0  # unconfirmed frames forgotten past keep_unconfirmed_bytes
        self.max_batch = max_batch
        self.max_batch_bytes = min(max_batch_bytes, max_frame_bytes)
        self._encoder = Encoder(max_frame_bytes)
        self._decoder = Decoder((Synced,))
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, hwm_frames)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_client(self._sock, curve)
        self._curve = curve is not None
        self._link = LinkWatch(self._sock, endpoint, curve=self._curve)  # drops; with CURVE, a refusal raises KeyRefused
        self._sock.connect(endpoint)
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._drainer: asyncio.Task | None = None
        self.sent = 0  # messages handed to ZeroMQ

    async def send(self, msg: Message) -> None:
        """Encode (raises ``DecodeError`` subclasses on invalid data), buffer, send in order."""
        self._append(msg)
        if len(self._buf) >= self.max_batch or self._buf_bytes >= self.max_batch_bytes:
            await self.flush()
        else:
            self._ensure_drainer()

    def send_nowait(self, msg: Message) -> None:
        """Like ``send`` without waiting (needs a running loop); raises ``Backpressure`` when 4 batches are pending."""
        if len(self._buf) >= 4 * self.max_batch or self._buf_bytes >= 4 * self.max_batch_bytes:
            raise Backpressure(f"publisher to {self.endpoint} has {len(self._buf)} messages waiting; await flush()")
        self._append(msg)
        self._ensure_drainer()

    def _append(self, msg: Message) -> None:
        data = self._encoder.encode(msg)
        self._buf.append(data)
        self._buf_bytes += len(data)

    def _ensure_drainer(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """The only code that writes data frames, so they leave in send order."""
        while self._buf:
            items, self._buf = self._buf[: self.max_batch], self._buf[self.max_batch :]
            self._buf_bytes = sum(map(len, self._buf)) if self._buf else 0
            frame = Encoder.frame(items)
            await self._sock.send(frame, copy=False)
            self.sent += len(items)  # (a Sync counts too; close enough for a progress figure)
            self._keep(frame)

    def _keep(self, frame: bytes) -> None:
        self._unconfirmed.append((frame, self._link.update().drops))
        self._unconfirmed_bytes += len(frame)
        while self._unconfirmed_bytes > self.keep_unconfirmed_bytes and len(self._unconfirmed) > 1:
            self._forget_first()
            self.unprotected += 1

    def _forget_first(self) -> None:
        self._unconfirmed_bytes -= len(self._unconfirmed.popleft()[0])
        self._first_unconfirmed += 1

    def _confirmed(self, end: int) -> None:
        """Forget the kept frames numbered below ``end``: the broker has them."""
        while self._unconfirmed and self._first_unconfirmed < end:
            self._forget_first()

    async def _resend(self, end: int) -> int:
        """Send the kept frames numbered below ``end`` again, then a new Sync; its token."""
        for frame, _ in list(self._unconfirmed)[: end - self._first_unconfirmed]:
            await self._sock.send(frame, copy=False)
            self.resent += 1
        token = next(_tokens)
        await self._sock.send(Encoder.frame([self._encoder.encode(Sync(SCHEMA_VERSION, token))]), copy=False)
        return token

    async def flush(self) -> None:
        """Wait until every buffered message is handed to ZeroMQ (queued, not yet confirmed); with CURVE keys,
        ``KeyRefused`` if the broker refused them."""
        while self._buf or (self._drainer is not None and not self._drainer.done()):
            self._ensure_drainer()
            if not self._curve:
                await self._drainer
                continue
            while not self._drainer.done():  # a refused client has no peer: its send would wait for good
                self._link.raise_if_refused()
                await asyncio.wait({self._drainer}, timeout=REFUSAL_CHECK_S)
            await self._drainer  # its own error, if it had one
        if self._curve:
            self._link.raise_if_refused()

    async def sync(self, timeout: float = 30.0) -> None:
        """Wait until the broker confirms it processed everything sent so far; ``TimeoutError`` if not."""
        token = next(_tokens)
        self._buf.append(self._encoder.encode(Sync(SCHEMA_VERSION, token)))  # rides with the last data
        await self.flush()
        end = self._first_unconfirmed + len(self._unconfirmed)  # the Sync is in the last frame below this number
        # each Sync sent, with the link's drop count when the first frame it covers left: its answer proves
        # those frames arrived only if the link has not dropped since
        rounds = {token: self._unconfirmed[0][1]}
        deadline = time.monotonic() + timeout
        resend_at = time.monotonic() + self.resend_every_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"the broker at {self.endpoint} did not confirm {self.sent} sent messages within {timeout:g} s")
            if now >= resend_at:  # the broker may have died and come back: what it never confirmed goes again
                drops = self._link.update().drops
                rounds[await self._resend(end)] = drops
                resend_at = now + self.resend_every_s
            wait_s = min(deadline, resend_at) - now
            if self._curve:
                self._link.raise_if_refused()
                wait_s = min(wait_s, REFUSAL_CHECK_S)
            if not await self._sock.poll(max(1, int(wait_s * 1000) + 1), zmq.POLLIN):
                continue
            frame = self._decoder.decode_frame(await self._sock.recv())
            answered = [rounds[m.token] for m in frame.messages if m.token in rounds]
            if not answered:
                continue
            if self._link.update().drops in answered:
                self._confirmed(end)
                return
            resend_at = 0.0  # answered, but the link dropped since: frames before that Sync may be lost

    async def aclose(self, timeout: float = 30.0) -> None:
        """Sync (see ``sync``), then close. Raises ``TimeoutError`` (after closing) if the broker never confirmed."""
        try:
            await self.sync(timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Close now; anything not yet confirmed by ``sync`` may be lost."""
        if self._drainer is not None and not self._drainer.done():
            self._drainer.cancel()
        self._link.close()
        self._sock.close(linger=0)


class BlockingPublisher:
    """The Publisher for code without an event loop (scripts, threads): same frames, same Sync.

    ``send`` buffers and sends a frame every ``max_batch`` messages (blocking at the high-water
    mark); ``flush`` sends the rest; ``close`` syncs first unless told not to. It keeps nothing to
    send again: a sync after the link dropped raises ``ConnectionError`` rather than confirm.
    """

    def __init__(self, endpoint: str, *, max_batch: int = 256, hwm_frames: int = 64,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, context: zmq.Context | None = None,
                 curve: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.max_batch = max_batch
        self._encoder = Encoder(max_frame_bytes)
        self._decoder = Decoder((Synced,))
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, hwm_frames)
        self._sock.setsockopt(zmq.LINGER, 0)
        apply_client(self._sock, curve)
        self._curve = curve is not None
        self._link = LinkWatch(self._sock, endpoint, curve=self._curve)
        self._sock.connect(endpoint)
        self._buf: list[bytes] = []
        self._drops_when_unconfirmed: int | None = None  # the link's drop count when the first unconfirmed frame left

    def send(self, msg: Message) -> None:
        self._buf.append(self._encoder.encode(msg))
        if len(self._buf) >= self.max_batch:
            self.flush()

    def flush(self, timeout: float | None = None) -> None:
        """Hand the buffer to ZeroMQ, waiting at the high-water mark (``TimeoutError`` after ``timeout``
        seconds, if given); with CURVE keys, ``KeyRefused`` once the broker has refused them."""
        if not self._buf:
            return
        frame = Encoder.frame(self._buf)
        if self._drops_when_unconfirmed is None:
            self._drops_when_unconfirmed = self._link.update().drops
        deadline = None if timeout is None else time.monotonic() + timeout
        # never a blocking send: a refused handshake drops the socket's only pipe, and a send that saw the pipe a
        # moment before would then wait forever, where this loop sees the refusal
        while True:
            if self._curve:
                self._link.raise_if_refused()  # sticks: a refused key sends nothing more
            try:
                self._sock.send(frame, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the broker at {self.endpoint} took nothing within {timeout:g} s")
            self._sock.poll(int(REFUSAL_CHECK_S * 1000), zmq.POLLOUT)  # no peer, or a full queue
        self._buf = []

    def sync(self, timeout: float = 30.0) -> None:
        """Block until the broker confirms everything sent so far; ``TimeoutError`` if it does not."""
        token = next(_tokens)
        self._buf.append(self._encoder.encode(Sync(SCHEMA_VERSION, token)))
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if self._curve:
                self._link.raise_if_refused()
                left_ms = min(left_ms, int(REFUSAL_CHECK_S * 1000))
            if self._sock.poll(left_ms, zmq.POLLIN) and any(
                    m.token == token for m in self._decoder.decode_frame(self._sock.recv()).messages):
                dropped = self._link.update().drops != self._drops_when_unconfirmed
                self._drops_when_unconfirmed = None
                if dropped:
                    raise ConnectionError(f"the link to the broker at {self.endpoint} dropped since the last sync: "
                                          "messages sent before it may be lost (Publisher re-sends; this one cannot)")
                return
        raise TimeoutError(f"the broker at {self.endpoint} did not confirm within {timeout:g} s")

    def close(self, sync_timeout: float | None = 30.0) -> None:
        """Sync (unless ``sync_timeout`` is None), then close."""
        try:
            if sync_timeout is not None:
                self.sync(sync_timeout)
        finally:
            self._link.close()
            self._sock.close(linger=0)


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
        self._token = next(_tokens)
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
            raise TimeoutError(f"no broker confirmed the subscription at {self.endpoint} within {timeout:g} s") from None

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
            raise TimeoutError(f"no broker confirmed the subscription at {self.endpoint} within {timeout:g} s") from None

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
