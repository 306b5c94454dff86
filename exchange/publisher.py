"""SEE publisher: the async ``Publisher`` that sends typed messages to the broker (``exchange.broker``).

A DEALER socket connected to the broker's frontend (a ROUTER). ``await send(msg)``
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

All socket I/O goes through pyzmq's asyncio layer (never a blocking call on the loop). Without an
event loop: ``exchange.blocking_publisher``; the other end: ``exchange.subscriber``.
"""

from __future__ import annotations

import asyncio
import collections
import time

import zmq
import zmq.asyncio

from exchange.codec import DEFAULT_MAX_FRAME_BYTES, Decoder, Encoder
from exchange.link import REFUSAL_CHECK_S, dealer_socket, next_token
from exchange.protocol import SCHEMA_VERSION, Message, Sync, Synced
from exchange.security import ClientKeys


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
        self._curve = curve is not None
        # drops; with CURVE, a refusal raises KeyRefused
        self._sock, self._link = dealer_socket(context or zmq.asyncio.Context.instance(), endpoint, hwm_frames, curve)
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
        token = next_token()
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
        token = next_token()
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
                raise TimeoutError(f"the broker at {self.endpoint} did not confirm {self.sent} sent messages "
                                   f"within {timeout:g} s")
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
