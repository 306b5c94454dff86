"""SEE blocking publisher: ``BlockingPublisher``, the publisher for code without an event loop.

The same frames and the same ``Sync`` as ``exchange.publisher.Publisher``, over a plain (blocking-API)
DEALER socket connected to the broker's frontend; it keeps nothing to send again after a broker restart.
"""

from __future__ import annotations

import time

import zmq

from exchange.codec import DEFAULT_MAX_FRAME_BYTES, Decoder, Encoder
from exchange.link import REFUSAL_CHECK_S, dealer_socket, next_token
from exchange.protocol import SCHEMA_VERSION, Message, Sync, Synced
from exchange.security import ClientKeys


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
        self._curve = curve is not None
        self._sock, self._link = dealer_socket(context or zmq.Context.instance(), endpoint, hwm_frames, curve)
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
        token = next_token()
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
