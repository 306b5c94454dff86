"""The broker's side of its subscribers: ``Subscription`` (one subscriber as the broker sees it: topic
prefixes, lossless or not, backlog, rate cap) and ``Fanout`` (every subscription, and routing to them).

Routing keeps order per subscriber. A subscriber whose socket queue is full gets a
backlog here, bounded by ``backlog_messages``. Lossless subscribers over the bound
pause the frontend (``must_pause``: publishers then wait at their high-water mark: back-pressure,
not loss); lossy ones lose what does not fit, counted in ``dropped``. A lossy one
may ask for a sample (``Subscribe.max_rate``: at most that many experiences/s, whole frames
of experiences dropped past it, counted the same way): a monitor at the exchange's full
rate then costs the broker and itself a bounded amount.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import zmq

from exchange.codec import Encoder, Frame
from exchange.protocol import SCHEMA_VERSION, Subscribe, Subscribed, Unsubscribe


@dataclass
class Subscription:
    """One subscriber as the broker sees it (``identity``: its ZeroMQ routing id on the backend)."""

    identity: bytes
    name: str
    prefixes: tuple[str, ...]
    lossless: bool
    backlog: deque = field(default_factory=deque)  # (frame, n_messages), oldest first
    waiting: int = 0  # messages in backlog
    dropped: int = 0
    max_rate: float = 0.0  # experiences/s this (lossy) subscriber takes: a sample, the rest dropped for it
    allowance: float = 0.0  # a token bucket of up to one second's worth; it may go into debt by one frame
    refilled: float = 0.0
    _wants: dict[str, bool] = field(default_factory=dict)

    def over_rate(self, n: int) -> bool:
        """True if a frame of ``n`` experiences would take this subscriber over its rate (it is then dropped)."""
        now = time.monotonic()
        self.allowance = min(self.max_rate, self.allowance + (now - self.refilled) * self.max_rate)
        self.refilled = now
        if self.allowance <= 0:
            return True
        self.allowance -= n  # a frame larger than a second's worth goes through, and the debt waits it out
        return False

    def wants(self, topic: str) -> bool:
        hit = self._wants.get(topic)
        if hit is None:
            hit = self._wants[topic] = any(topic.startswith(p) for p in self.prefixes)
        return hit


class Fanout:
    """Every subscription of a broker and what is on its way to each, over the broker's ``backend`` ROUTER."""

    def __init__(self, backend: zmq.Socket, backlog_messages: int, encoder: Encoder) -> None:
        self.backend = backend
        self.backlog_messages = backlog_messages
        self._encoder = encoder
        self.subs: dict[bytes, Subscription] = {}
        self.dropped = 0  # lost for a subscriber (lossy: over its backlog or its rate); the broker adds late ones
        self.window = Counter()  # topic -> messages in this stats window
        self.window_dropped = 0

    def must_pause(self) -> bool:
        """A lossless subscriber is at its backlog bound: stop reading publishers until it drains."""
        return any(s.lossless and s.waiting >= self.backlog_messages for s in self.subs.values())

    def route(self, topics: list[str], frame: Frame, count: bool = True) -> None:
        """Hands each subscriber the messages whose topic it wants, as one frame, in order."""
        uniform = topics[0] if topics.count(topics[0]) == len(topics) else None
        if count and uniform is not None:
            self.window[uniform] += len(topics)
        elif count:
            self.window.update(topics)
        counts = None if uniform is not None else Counter(topics)
        for sub in list(self.subs.values()):
            if uniform is not None:
                if sub.wants(uniform) and not self._sampled_out(sub, uniform, len(topics)):
                    self.deliver(sub, frame.whole or Encoder.frame(frame.raws), len(topics))
                continue
            if all(sub.wants(t) for t in counts):  # per topic, not per message: a broker's core is the exchange's limit
                self._route_all(sub, frame, topics, counts)
                continue
            picked = [raw for raw, t in zip(frame.raws, topics) if sub.wants(t)]
            if sub.max_rate and picked:
                picked = self._sampled(sub, frame.raws, topics)
            if len(picked) == len(topics) and frame.whole is not None:
                self.deliver(sub, frame.whole, len(picked))
            elif picked:
                self.deliver(sub, Encoder.frame(picked), len(picked))

    def _route_all(self, sub: Subscription, frame: Frame, topics: list[str], counts: Counter) -> None:
        """Hands ``sub``, which wants every topic of a mixed frame, all of it (less its experiences when over its
        rate)."""
        n_exps = sum(n for t, n in counts.items() if t.startswith("exp.")) if sub.max_rate else 0
        if n_exps and self._sampled_out(sub, "exp.", n_exps):
            if n_exps < len(topics):
                picked = [raw for raw, t in zip(frame.raws, topics) if not t.startswith("exp.")]
                self.deliver(sub, Encoder.frame(picked), len(picked))
            return
        self.deliver(sub, frame.whole or Encoder.frame(frame.raws), len(topics))

    def _sampled(self, sub: Subscription, raws: list, topics: list[str]) -> list:
        """What a rate-capped subscriber gets of a mixed frame: all it wants, less the experiences when over its
        rate."""
        n_exps = sum(t.startswith("exp.") and sub.wants(t) for t in topics)
        out = self._sampled_out(sub, "exp.", n_exps) if n_exps else False
        return [raw for raw, t in zip(raws, topics) if sub.wants(t) and not (out and t.startswith("exp."))]

    def _sampled_out(self, sub: Subscription, topic: str, n: int) -> bool:
        """A rate-capped subscriber over its rate loses these ``n`` experiences (counted as dropped for it).
        Only experiences are sampled, a frame's all at once: stats, assignments and controls always go through."""
        if not sub.max_rate or not topic.startswith("exp.") or not sub.over_rate(n):
            return False
        sub.dropped += n
        self.dropped += n
        self.window_dropped += n
        return True

    def deliver(self, sub: Subscription, frame: bytes, n: int) -> None:
        if not sub.backlog and self._send(sub, frame):
            return
        if sub.identity not in self.subs:
            return
        if not sub.lossless and sub.waiting + n > self.backlog_messages:
            sub.dropped += n
            self.dropped += n
            self.window_dropped += n
            return
        sub.backlog.append((frame, n))
        sub.waiting += n

    def _send(self, sub: Subscription, frame: bytes) -> bool:
        """True if ZeroMQ took the frame; False if the peer's queue is full. Forgets vanished peers."""
        try:
            self.backend.send_multipart((sub.identity, frame), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget(sub)
            return False

    def _forget(self, sub: Subscription) -> None:
        self.subs.pop(sub.identity, None)
        sub.backlog.clear()
        sub.waiting = 0

    def retry_backlogs(self) -> bool:
        """Send what the subscribers' queues take now; True if anything moved."""
        moved = False
        for sub in list(self.subs.values()):
            while sub.backlog and self._send(sub, sub.backlog[0][0]):
                _, n = sub.backlog.popleft()
                sub.waiting -= n
                moved = True
        return moved

    def on_link(self, identity: bytes, msg: Subscribe | Unsubscribe, stopping: bool) -> None:
        """A subscriber's ``Subscribe`` (answered ``Subscribed``, in order with its frames) or ``Unsubscribe``;
        while ``stopping``, no new subscriber is taken."""
        if type(msg) is Unsubscribe:
            if identity in self.subs:
                self._forget(self.subs[identity])
            return
        sub = self.subs.get(identity)
        if sub is None and stopping:
            return  # shutting down: no new subscriptions
        if sub is None:
            taken = {s.name for s in self.subs.values()}
            name = msg.name if msg.name not in taken else f"{msg.name}#{identity.hex()[-6:]}"
            sub = self.subs[identity] = Subscription(identity, name, (), msg.lossless)
        sub.prefixes, sub.lossless, sub._wants = tuple(msg.topics), msg.lossless, {}
        rate = msg.max_rate if not msg.lossless and msg.max_rate > 0 and msg.max_rate != float("inf") else 0.0
        if rate != sub.max_rate:
            sub.max_rate, sub.allowance, sub.refilled = rate, rate, time.monotonic()
        ack = Encoder.frame([self._encoder.encode(Subscribed(SCHEMA_VERSION, msg.token))])
        self.deliver(sub, ack, 0)
