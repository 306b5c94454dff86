"""SEE hub: the ``Broker``, its one poll loop: receives from publishers, checks, logs Experience, routes to
subscribers by topic, answers syncs, counts, publishes Stats, and shuts down.

    publishers (DEALER) --frames--> [frontend ROUTER | broker | backend ROUTER] --frames--> subscribers (DEALER)

One thread, one poll loop (this is meant to be its own process: ``exchange.broker`` runs it). The
subscribers and routing to them are ``exchange.broker_fanout``'s; the ids that refuse a re-send,
``exchange.broker_dedupe``'s. Invariants:

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
- Routing keeps order per subscriber; a full subscriber gets a backlog, bounded by ``backlog_messages``:
  lossless ones over it pause the frontend, lossy ones lose what does not fit (and what a
  ``Subscribe.max_rate`` samples out), counted in ``dropped_total`` (``exchange.broker_fanout``). Every
  backlog is visible in ``Stats.subscriber_backlog`` (topic ``stats``, every
  ``stats_interval_s``, and once more on the way out).
- Stops on ``Control(command="stop")`` with target "*" or its name (forwarded first),
  or on SIGTERM/SIGINT: delivers backlogs for up to ``drain_timeout_s``, closes the log.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import zmq

from exchange.broker_config import BrokerConfig
from exchange.broker_dedupe import logged_ids
from exchange.broker_fanout import Fanout
from exchange.codec import Decoder, Encoder, Frame
from exchange.log import ExperienceLogWriter
from exchange.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Closing,
    Control,
    Experience,
    Stats,
    Subscribe,
    Sync,
    Synced,
    Unsubscribe,
    topic_for,
)
from exchange.security import CurveServer

MAX_SENDERS_SHOWN = 32  # per-sender reject counts in Stats: the worst offenders


def sender_name(identity: bytes) -> str:
    """How logs and Stats name a publisher connection (ZeroMQ's routing id of it)."""
    return f"peer-{identity.hex()}"


class Broker:
    """The hub's state and loop; ``exchange.broker.run_broker`` is the entry point."""

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
        self._logged_ids = logged_ids(config.log_dir, config.dedupe_ids) if self._log else None
        self.duplicates = 0
        self.fanout = Fanout(self._backend, config.backlog_messages, self._encoder)  # the subscribers
        self._stopping = False
        self.accepted = self.rejected = 0
        self._window_rejected = self._window_exps = 0  # in this stats window (routed and dropped: the fanout's)
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
            paused = self.fanout.must_pause()
            if paused == reading:
                poller.modify(self._frontend, 0 if paused else zmq.POLLIN)
                reading = not paused
            backlogged = any(s.backlog for s in self.fanout.subs.values())
            wait_ms = retry_ms if backlogged else min(100, max(0, int((next_stats - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            if self._backend in events:
                self._drain_backend()
            if self._frontend in events:
                self._drain_frontend()
            if backlogged:  # retry soon while backlogs move, back off to 50 ms while they are stuck
                retry_ms = 1 if self.fanout.retry_backlogs() else min(50, retry_ms * 2)
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
            if self._stopping or self.fanout.must_pause():
                return

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
        self.fanout.route(topics, frame)
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
                    self.fanout.on_link(identity, msg, self._stopping)


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
        fanout = self.fanout
        backlog = {s.name: s.waiting for s in fanout.subs.values()}
        stats = Stats(
            SCHEMA_VERSION, self.config.name, "broker", "", time.time(), window,
            samples_per_s=self._window_exps / window,
            queue_depth=max(backlog.values(), default=0),
            dropped=fanout.window_dropped, rejected=self._window_rejected,
            accepted_total=self.accepted, rejected_total=self.rejected, dropped_total=fanout.dropped,
            topic_rates={t: c / window for t, c in fanout.window.items()},
            subscriber_backlog=backlog,
            rejected_by_sender={sender_name(k): v for k, v in self._rejects_by.most_common(MAX_SENDERS_SHOWN)},
            cut_off=sorted(sender_name(k) for k in self._cut_off)[:MAX_SENDERS_SHOWN],
            duplicate_total=self.duplicates,
            subscriber_dropped={s.name: s.dropped for s in fanout.subs.values() if s.dropped},
        )
        fanout.window.clear()
        self._window_rejected = fanout.window_dropped = self._window_exps = 0
        self._window_start = now
        encoded = self._encoder.encode(stats)
        fanout.route(["stats"], Frame([stats], whole=Encoder.frame([encoded])), count=False)
        if self._log:
            self._log.flush()

    def _shutdown(self) -> None:
        """Final Stats, then ``Closing`` to every subscriber; wait (up to drain_timeout_s) until each
        has answered, which proves it received every earlier frame; then close."""
        self._publish_stats()
        closing = Encoder.frame([self._encoder.encode(Closing(SCHEMA_VERSION))])
        for sub in list(self.fanout.subs.values()):
            self.fanout.deliver(sub, closing, 0)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.fanout.subs and time.monotonic() < deadline:
            self.fanout.retry_backlogs()
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
                self.fanout.dropped += late
                for m in frame.messages:
                    if type(m) is Sync:
                        self._answer_sync(parts[0], m)
