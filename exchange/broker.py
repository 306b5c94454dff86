"""SEE hub: receives from publishers, checks, logs Experience, routes to subscribers by topic.

    publishers (DEALER) --frames--> [frontend ROUTER | broker | backend ROUTER] --frames--> subscribers (DEALER)

One thread, one poll loop (this is meant to be its own process: ``run_broker(config)``
is a spawn target, ``python -m exchange.broker`` the command line). Invariants:

- Every frame is decoded and validated (and, with ``run_id`` set, an Experience must carry
  it); bad frames and bad messages are counted
  (``Stats.rejected_total``, and per sender), never forwarded, never logged, never fatal.
  A sender past ``max_rejects_per_sender`` is cut off (named on stderr and in ``Stats.cut_off``).
- Every accepted Experience is appended to the log (if ``log_dir``) and handed to the kernel
  before it is routed,
  once: an experience id the log holds already (a publisher re-sending what a broker that
  died never confirmed; the ids of an existing log are read on start) is counted in
  ``Stats.duplicate_total`` and neither logged nor routed again. Of the ids, the newest
  ``dedupe_ids // 2`` at least are remembered (a re-send is recent: memory stays bounded).
  A publisher's ``Sync`` is answered after everything it sent before has been handled.
- Routing keeps order per subscriber. A subscriber whose socket queue is full gets a
  backlog here, bounded by ``backlog_messages``. Lossless subscribers over the bound
  pause the frontend (publishers then wait at their high-water mark: back-pressure,
  not loss); lossy ones lose what does not fit, counted in ``dropped_total``. A lossy one
  may ask for a sample (``Subscribe.max_rate``: at most that many experiences/s, whole frames
  of experiences dropped past it, counted the same way): a monitor at the exchange's full
  rate then costs the broker and itself a bounded amount. Every
  backlog is visible in ``Stats.subscriber_backlog`` (topic ``stats``, every
  ``stats_interval_s``, and once more on the way out).
- Stops on ``Control(command="stop")`` with target "*" or its name (forwarded first),
  or on SIGTERM/SIGINT: delivers backlogs for up to ``drain_timeout_s``, closes the log.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import zmq

from exchange.broker_config import BrokerConfig, ConfigError
from exchange.codec import Decoder, Encoder, Frame
from exchange.log import ExperienceLogReader, ExperienceLogWriter
from exchange.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Closing,
    Control,
    Experience,
    Stats,
    Subscribe,
    Subscribed,
    Sync,
    Synced,
    Unsubscribe,
    topic_for,
)
from exchange.security import CurveServer, KeyFileError

MAX_SENDERS_SHOWN = 32  # per-sender reject counts in Stats: the worst offenders


def sender_name(identity: bytes) -> str:
    """How logs and Stats name a publisher connection (ZeroMQ's routing id of it)."""
    return f"peer-{identity.hex()}"


class _RecentIds:
    """Recent experience ids, for refusing re-sends in bounded memory: at least the newest
    ``limit // 2``, at most ``limit`` (two generations of sets: the older is dropped when the newer fills).

    A publisher re-sends only what a broker never confirmed (``Publisher.keep_unconfirmed_bytes`` a
    publisher, 16 MB by default), so only recent ids can come again; a run of millions of
    experiences would otherwise hold every id for its whole length."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self._new: set[str] = set()
        self._old: set[str] = set()

    def first_seen(self, messages: list) -> list[int]:
        """The indices of ``messages`` that are not an Experience already seen (each is remembered now)."""
        keep = []
        new, old, half = self._new, self._old, self.half
        for i, m in enumerate(messages):
            if type(m) is Experience:
                eid = m.experience_id
                if eid in new or eid in old:
                    continue
                new.add(eid)
                if len(new) >= half:
                    self._old, self._new = old, new = new, set()
            keep.append(i)
        return keep


@dataclass
class _Subscriber:
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


class Broker:
    """The hub's state and loop; ``run_broker`` is the entry point."""

    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None) -> None:
        config.check()
        self.config = config
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._curve = (CurveServer(self._ctx, config.curve_secret_key, config.curve_allowed_dir)
                       if config.curve else None)
        if self._curve:
            self._curve.start()  # before bind: no client is served unauthenticated
        self._frontend = self._ctx.socket(zmq.ROUTER)
        self._frontend.setsockopt(zmq.RCVHWM, config.hwm_frames)
        self._backend = self._ctx.socket(zmq.ROUTER)
        self._backend.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer raises Again instead of dropping
        self._backend.setsockopt(zmq.SNDHWM, config.hwm_frames)
        for sock, endpoint in ((self._frontend, config.frontend), (self._backend, config.backend)):
            if self._curve:
                self._curve.apply(sock)
            sock.bind(endpoint)
        self._decoder = Decoder((*MESSAGE_TYPES, Sync), config.max_frame_bytes)
        self._link_decoder = Decoder((Subscribe, Unsubscribe), config.max_frame_bytes)
        self._encoder = Encoder(config.max_frame_bytes)
        self._log = ExperienceLogWriter(config.log_dir, config.segment_bytes) if config.log_dir else None
        # the newest ids logged: a restarted broker reopens the log and refuses what it holds already
        self._logged_ids = _RecentIds(config.dedupe_ids) if self._log else None
        if self._logged_ids is not None:
            for e in ExperienceLogReader(config.log_dir):
                self._logged_ids.first_seen([e])
        self.duplicates = 0
        self._subs: dict[bytes, _Subscriber] = {}
        self._stopping = False
        self.accepted = self.rejected = self.dropped = 0
        self._window = Counter()  # topic -> messages in this stats window
        self._window_rejected = self._window_dropped = self._window_exps = 0
        self._window_start = time.monotonic()
        self._rejects_by: Counter[bytes] = Counter()  # sender identity -> bad messages
        self._cut_off: set[bytes] = set()

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    # --- the loop ---

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._backend, zmq.POLLIN)
        poller.register(self._frontend, zmq.POLLIN)
        reading, retry_ms = True, 1
        next_stats = time.monotonic() + self.config.stats_interval_s
        while not self._stopping:
            paused = self._must_pause()
            if paused == reading:
                poller.modify(self._frontend, 0 if paused else zmq.POLLIN)
                reading = not paused
            backlogged = any(s.backlog for s in self._subs.values())
            wait_ms = retry_ms if backlogged else min(100, max(0, int((next_stats - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            if self._backend in events:
                self._drain_backend()
            if self._frontend in events:
                self._drain_frontend()
            if backlogged:  # retry soon while backlogs move, back off to 50 ms while they are stuck
                retry_ms = 1 if self._retry_backlogs() else min(50, retry_ms * 2)
            if time.monotonic() >= next_stats:
                self._publish_stats()
                next_stats = time.monotonic() + self.config.stats_interval_s
            if self._log and self._frontend not in events:
                self._log.flush()  # idle: hand what we logged to the OS
        self._shutdown()

    def _drain_frontend(self, max_frames: int = 32) -> None:
        for _ in range(max_frames):
            try:
                parts = self._frontend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if parts[0] in self._cut_off:  # dropped unread: this sender has sent too many bad frames
                self._count_rejects(parts[0], len(parts[1:]) or 1)
                continue
            for data in parts[1:] or [b""]:
                self._accept(parts[0], self._decoder.decode_frame(data))
            if self._stopping or self._must_pause():
                return

    def _must_pause(self) -> bool:
        """A lossless subscriber is at its backlog bound: stop reading publishers until it drains."""
        return any(s.lossless and s.waiting >= self.config.backlog_messages for s in self._subs.values())

    def _accept(self, sender: bytes, frame: Frame) -> None:
        self._count_rejects(sender, len(frame.errors))
        if self.config.run_id:
            frame = self._this_run_only(sender, frame)
        messages = frame.messages
        syncs = [m for m in messages if type(m) is Sync]
        if syncs:  # link messages: answered below, never routed
            keep = [i for i, m in enumerate(messages) if type(m) is not Sync]
            frame = Frame([messages[i] for i in keep], [frame.raws[i] for i in keep])
        if frame.messages:
            self._route_accepted(frame)
        for sync in syncs:
            self._answer_sync(sender, sync)

    def _route_accepted(self, frame: Frame) -> None:
        if self._logged_ids is not None:
            frame = self._without_repeats(frame)
            if not frame.messages:
                return
        messages = frame.messages
        self.accepted += len(messages)
        topics = [topic_for(m) for m in messages]
        n_exps = sum(type(m) is Experience for m in messages)
        self._window_exps += n_exps
        if self._log and n_exps:
            if n_exps == len(messages) and frame.whole is not None:
                self._log.append_frame(frame.whole)  # the frame is already a log payload
            else:
                self._log.append_raw([raw for m, raw in zip(messages, frame.raws) if type(m) is Experience])
            self._log.flush()  # in the kernel before anyone sees it: a killed broker never routed what it lost
        self._route(topics, frame)
        for m in messages:
            if type(m) is Control and m.command == "stop" and m.target in ("*", self.config.name):
                self._stopping = True

    def _this_run_only(self, sender: bytes, frame: Frame) -> Frame:
        """``frame`` less the experiences of another run id (counted as rejected against ``sender``)."""
        run_id = self.config.run_id
        keep = [i for i, m in enumerate(frame.messages) if type(m) is not Experience or m.run_id == run_id]
        if len(keep) == len(frame.messages):
            return frame
        self._count_rejects(sender, len(frame.messages) - len(keep))
        return Frame([frame.messages[i] for i in keep], [frame.raws[i] for i in keep])

    def _without_repeats(self, frame: Frame) -> Frame:
        """``frame`` less the experiences whose id is logged already (counted in ``duplicates``)."""
        keep = self._logged_ids.first_seen(frame.messages)
        if len(keep) == len(frame.messages):
            return frame
        self.duplicates += len(frame.messages) - len(keep)
        return Frame([frame.messages[i] for i in keep], [frame.raws[i] for i in keep])

    def _answer_sync(self, sender: bytes, sync: Sync) -> None:
        if self._log:
            self._log.flush()  # "processed" includes: handed to the OS
        answer = Encoder.frame([self._encoder.encode(Synced(SCHEMA_VERSION, sync.token, self.accepted))])
        try:
            self._frontend.send_multipart((sender, answer), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the publisher left or is not reading; it will time out and say so

    def _route(self, topics: list[str], frame: Frame, count: bool = True) -> None:
        """Hands each subscriber the messages whose topic it wants, as one frame, in order."""
        uniform = topics[0] if topics.count(topics[0]) == len(topics) else None
        if count and uniform is not None:
            self._window[uniform] += len(topics)
        elif count:
            self._window.update(topics)
        counts = None if uniform is not None else Counter(topics)
        for sub in list(self._subs.values()):
            if uniform is not None:
                if sub.wants(uniform) and not self._sampled_out(sub, uniform, len(topics)):
                    self._deliver(sub, frame.whole or Encoder.frame(frame.raws), len(topics))
                continue
            if all(sub.wants(t) for t in counts):  # per topic, not per message: a broker's core is the exchange's limit
                self._route_all(sub, frame, topics, counts)
                continue
            picked = [raw for raw, t in zip(frame.raws, topics) if sub.wants(t)]
            if sub.max_rate and picked:
                picked = self._sampled(sub, frame.raws, topics)
            if len(picked) == len(topics) and frame.whole is not None:
                self._deliver(sub, frame.whole, len(picked))
            elif picked:
                self._deliver(sub, Encoder.frame(picked), len(picked))

    def _route_all(self, sub: _Subscriber, frame: Frame, topics: list[str], counts: Counter) -> None:
        """Hands ``sub``, which wants every topic of a mixed frame, all of it (less its experiences when over its rate)."""
        n_exps = sum(n for t, n in counts.items() if t.startswith("exp.")) if sub.max_rate else 0
        if n_exps and self._sampled_out(sub, "exp.", n_exps):
            if n_exps < len(topics):
                picked = [raw for raw, t in zip(frame.raws, topics) if not t.startswith("exp.")]
                self._deliver(sub, Encoder.frame(picked), len(picked))
            return
        self._deliver(sub, frame.whole or Encoder.frame(frame.raws), len(topics))

    def _sampled(self, sub: _Subscriber, raws: list, topics: list[str]) -> list:
        """What a rate-capped subscriber gets of a mixed frame: all it wants, less the experiences when over its rate."""
        n_exps = sum(t.startswith("exp.") and sub.wants(t) for t in topics)
        out = self._sampled_out(sub, "exp.", n_exps) if n_exps else False
        return [raw for raw, t in zip(raws, topics) if sub.wants(t) and not (out and t.startswith("exp."))]

    def _sampled_out(self, sub: _Subscriber, topic: str, n: int) -> bool:
        """A rate-capped subscriber over its rate loses these ``n`` experiences (counted as dropped for it).
        Only experiences are sampled, a frame's all at once: stats, assignments and controls always go through."""
        if not sub.max_rate or not topic.startswith("exp.") or not sub.over_rate(n):
            return False
        sub.dropped += n
        self.dropped += n
        self._window_dropped += n
        return True

    def _deliver(self, sub: _Subscriber, frame: bytes, n: int) -> None:
        if not sub.backlog and self._send(sub, frame):
            return
        if sub.identity not in self._subs:
            return
        if not sub.lossless and sub.waiting + n > self.config.backlog_messages:
            sub.dropped += n
            self.dropped += n
            self._window_dropped += n
            return
        sub.backlog.append((frame, n))
        sub.waiting += n

    def _send(self, sub: _Subscriber, frame: bytes) -> bool:
        """True if ZeroMQ took the frame; False if the peer's queue is full. Forgets vanished peers."""
        try:
            self._backend.send_multipart((sub.identity, frame), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget(sub)
            return False

    def _forget(self, sub: _Subscriber) -> None:
        self._subs.pop(sub.identity, None)
        sub.backlog.clear()
        sub.waiting = 0

    def _retry_backlogs(self) -> bool:
        """Send what the subscribers' queues take now; True if anything moved."""
        moved = False
        for sub in list(self._subs.values()):
            while sub.backlog and self._send(sub, sub.backlog[0][0]):
                _, n = sub.backlog.popleft()
                sub.waiting -= n
                moved = True
        return moved

    # --- subscribers ---

    def _drain_backend(self) -> None:
        while True:
            try:
                parts = self._backend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = parts[0]
            for data in parts[1:] or [b""]:
                frame = self._link_decoder.decode_frame(data)
                self._count_rejects(identity, len(frame.errors))
                for msg in frame.messages:
                    self._on_link(identity, msg)

    def _on_link(self, identity: bytes, msg: Subscribe | Unsubscribe) -> None:
        if type(msg) is Unsubscribe:
            if identity in self._subs:
                self._forget(self._subs[identity])
            return
        sub = self._subs.get(identity)
        if sub is None and self._stopping:
            return  # shutting down: no new subscriptions
        if sub is None:
            taken = {s.name for s in self._subs.values()}
            name = msg.name if msg.name not in taken else f"{msg.name}#{identity.hex()[-6:]}"
            sub = self._subs[identity] = _Subscriber(identity, name, (), msg.lossless)
        sub.prefixes, sub.lossless, sub._wants = tuple(msg.topics), msg.lossless, {}
        rate = msg.max_rate if not msg.lossless and msg.max_rate > 0 and msg.max_rate != float("inf") else 0.0
        if rate != sub.max_rate:
            sub.max_rate, sub.allowance, sub.refilled = rate, rate, time.monotonic()
        ack = Encoder.frame([self._encoder.encode(Subscribed(SCHEMA_VERSION, msg.token))])
        self._deliver(sub, ack, 0)

    def _count_rejects(self, sender: bytes, n: int) -> None:
        """Count ``n`` bad messages from ``sender``; past ``max_rejects_per_sender`` it is cut off, by name."""
        if not n:
            return
        self.rejected += n
        self._window_rejected += n
        self._rejects_by[sender] += n
        if self._rejects_by[sender] >= self.config.max_rejects_per_sender and sender not in self._cut_off:
            self._cut_off.add(sender)
            print(f"[{self.config.name}] sender {sender_name(sender)} cut off after {self._rejects_by[sender]} bad "
                  "messages: what it sends from now on is dropped unread", file=sys.stderr, flush=True)

    # --- stats and shutdown ---

    def _publish_stats(self) -> None:
        now = time.monotonic()
        window = max(now - self._window_start, 1e-9)
        backlog = {s.name: s.waiting for s in self._subs.values()}
        stats = Stats(
            SCHEMA_VERSION, self.config.name, "broker", "", time.time(), window,
            samples_per_s=self._window_exps / window,
            queue_depth=max(backlog.values(), default=0),
            dropped=self._window_dropped, rejected=self._window_rejected,
            accepted_total=self.accepted, rejected_total=self.rejected, dropped_total=self.dropped,
            topic_rates={t: c / window for t, c in self._window.items()},
            subscriber_backlog=backlog,
            rejected_by_sender={sender_name(k): v for k, v in self._rejects_by.most_common(MAX_SENDERS_SHOWN)},
            cut_off=sorted(sender_name(k) for k in self._cut_off)[:MAX_SENDERS_SHOWN],
            duplicate_total=self.duplicates,
            subscriber_dropped={s.name: s.dropped for s in self._subs.values() if s.dropped},
        )
        self._window.clear()
        self._window_rejected = self._window_dropped = self._window_exps = 0
        self._window_start = now
        encoded = self._encoder.encode(stats)
        self._route(["stats"], Frame([stats], whole=Encoder.frame([encoded])), count=False)
        if self._log:
            self._log.flush()

    def _shutdown(self) -> None:
        """Final Stats, then ``Closing`` to every subscriber; wait (up to drain_timeout_s) until each
        has answered, which proves it received every earlier frame; then close."""
        self._publish_stats()
        closing = Encoder.frame([self._encoder.encode(Closing(SCHEMA_VERSION))])
        for sub in list(self._subs.values()):
            self._deliver(sub, closing, 0)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._subs and time.monotonic() < deadline:
            self._retry_backlogs()
            if self._backend.poll(2, zmq.POLLIN):
                self._drain_backend()  # their Unsubscribe answers
        self._refuse_late_frames(time.monotonic() + 0.2)
        if self._log:
            self._log.close()
        self._frontend.close(linger=100)
        self._backend.close(linger=100)
        if self._curve:
            self._curve.stop()
        if self._own_context:
            self._ctx.term()

    def _refuse_late_frames(self, until: float) -> None:
        """After a stop: answer Syncs still arriving (so publishers can close), count late data as dropped."""
        while time.monotonic() < until and self._frontend.poll(20, zmq.POLLIN):
            parts = self._frontend.recv_multipart()
            for data in parts[1:]:
                frame = self._decoder.decode_frame(data)
                late = sum(type(m) is not Sync for m in frame.messages)
                self.dropped += late
                for m in frame.messages:
                    if type(m) is Sync:
                        self._answer_sync(parts[0], m)


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
    parser = argparse.ArgumentParser(prog="python -m exchange.broker", description="Run the SEE hub (shared experience exchange broker).")
    parser.add_argument("--frontend", default=defaults.frontend, help="endpoint publishers connect to (default: %(default)s)")
    parser.add_argument("--backend", default=defaults.backend, help="endpoint subscribers connect to (default: %(default)s)")
    parser.add_argument("--log-dir", default=None, help="experience log directory (default: no log)")
    parser.add_argument("--backlog-messages", type=int, default=defaults.backlog_messages, help="per-subscriber backlog bound (default: %(default)s)")
    parser.add_argument("--stats-interval", type=float, default=defaults.stats_interval_s, help="seconds between Stats (default: %(default)s)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow binding non-loopback tcp addresses (needs --curve-secret-key and --curve-allowed-dir)")
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

__all__ = ["Broker", "BrokerConfig", "ConfigError", "run_broker", "spawn_broker", "main"]
