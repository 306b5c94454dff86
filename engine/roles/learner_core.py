"""A model's learner state on one worker: parameters, optimizer, RNG and totals (every rank), and the
inbox (the leader only): the subscription to every model's experience, bridged by the THL on arrival
(``engine.train.ingest``), the run's metrics and TensorBoard writers, the weight channel's writer, and the
resume and broker-restart replays from the experience log. ``engine.roles.learner`` runs the group protocol
over it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import model_spec
from exchange.records import MetricsWriter
from engine.record.tbevents import EventWriter
from engine.train import checkpoint
from engine.train import group as dp
from engine.train.capability import CapabilityWindow
from engine.train.ingest import Ingest
from engine.train.optim import adamw
from engine.train.reference import starting_reference
from engine.train.sharding import ShardedTwin
from engine.weights.ends import weight_writer
from exchange.log import ExperienceLogReader
from exchange.protocol import Experience
from exchange.subscriber import Subscriber
from policies.models import build_policy, pad_token_id
from policies.objectives import peer_need

MAX_INGEST_BATCH = 256  # experiences bridged at once: bounds how long one ingest holds the event loop


@dataclass
class Pending:
    """A leader's next step, kept until its optimizer step happened (retried after a broken formation)."""

    prompts: list[int]
    raw: bytes  # the step payload every rank trains on
    own: list
    peers: list  # every peer sample that arrived for the prompts (the objective may read fewer)
    misses: int
    solo: bool
    idle_s: float
    peer_wait_s: float
    cut: int = 0  # own samples that hit train.max_new_tokens (finish_reason "length")


def newly_gone(gone: dict[str, str], announced: set[str], peers: list[str], version: int, steps: int) -> list[str]:
    """The peers gone and not yet said to be, when this model still has a step to train without them: at its last
    step (``version`` = ``steps``) it trains nothing more, so "training solo from step steps+1" would be false."""
    if version >= steps:
        return []
    return [peer for peer in gone if peer in peers and peer not in announced]


class LearnerCore:
    """A model's training state on this worker (every rank), and the inbox (the leader only)."""

    def __init__(self, worker, model: str):
        self.worker, self.model_name = worker, model
        cfg = worker.cfg
        self.cfg, self.spec = cfg, cfg.model(model)
        policy = worker.policy(model)
        self.tok, self.module = policy.tokenizer, policy.module
        self.module.train()
        self.pad_id = pad_token_id(self.tok)
        self.lr = self.spec.lr or cfg.train.lr
        trained = [p for p in self.module.parameters() if p.requires_grad]  # with LoRA: the adapters
        optimizer = adamw(trained, lr=self.lr, betas=cfg.train.adam_betas)
        # a CPU generator on any device: its state is what sync_state broadcasts and state_digest hashes
        rng = torch.Generator().manual_seed(cfg.run.seed * 1000 + cfg.names.index(model))
        self.state = dp.TrainState(self.module, optimizer, rng)
        if cfg.objective.kind == "hacpo":  # its capability window over whole steps (engine.train.capability)
            self.state.capability = CapabilityWindow(cfg.objective.capability_window)
        if cfg.objective.kl_coef > 0:  # the starting weights: the warm start, also when a checkpoint is resumed below
            warm = worker.plan.warm_checkpoints[model]
            self.state.reference = starting_reference(self.module, lambda: build_policy(model_spec(self.spec, warm),
                                                                                        self.tok))
        self.totals = {"own_experiences": 0, "peer_experiences": 0, "peer_used": 0, "peer_misses": 0,
                       "staleness_dropped": 0}
        self.consumed: set[int] = set()  # prompts trained before this run was resumed
        self.resume = worker.resume.pop(model, None)  # a resumed run's checkpoint: taken once per worker
        if self.resume:  # every rank: the group's state_digest must agree before the first step ("": warm start)
            self.consumed = checkpoint.restore(Path(self.resume), self.state, self.totals, worker.device)
        self.peers = [n for n in cfg.names if n != model]
        self.need = peer_need(cfg.objective.kind)
        self.sub: Subscriber | None = None  # the leader's inbox, once opened
        self.pending: Pending | None = None
        self.twin: ShardedTwin | None = None  # a sharded formation's state (train.sharding = "fsdp2")
        self.lost = False  # a sharded formation broke: this state must never be saved or trained on
        self.announced: set[str] = set()
        self.started = self.last_stats = time.time()

    async def open_inbox(self) -> None:
        if self.sub is not None:
            return
        w = self.worker
        peers = {n: w.tokenizer(n) for n in self.peers}
        self.ingest = Ingest(self.spec, self.tok, peers, w.task, self.cfg.train.group_size, w.plan.run_id,
                             {n: self.cfg.model(n).end for n in self.peers})
        self.ingest.consumed.update(self.consumed)
        self.sub = Subscriber(w.plan.broker_out, [f"exp.{n}" for n in self.cfg.names], name=f"{w.id}.{self.model_name}",
                              curve=w.plan.curve)
        await self.sub.ready(timeout=self.cfg.timeouts.worker_start_s)
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: w.inbox.changed.set())
        self.metrics = MetricsWriter(w.plan.run_dir, self.model_name)
        self.writer = weight_writer(w, self.model_name, self.module)
        acc = w.plan.warm_accuracy.get(self.model_name, [None, None])
        self.warm = {"warm_accuracy": acc[0], "warm_accuracy_stderr": acc[1]}
        self.metrics.write(event="start", step=self.state.version, weight_version=self.state.version,
                           weight_sync_bytes=self.writer.nbytes, **self.warm)
        tb_dir = Path(w.plan.run_dir) / "tensorboard" / self.model_name
        self.tb = EventWriter(tb_dir) if self.cfg.run.tensorboard else None
        self.log_scalars(self.state.version, self.warm)
        if self.resume is not None:
            await self._resume()

    async def _resume(self) -> None:
        """Generators get the checkpoint's weights; the log's experience of untrained prompts comes back in."""
        await asyncio.to_thread(self.writer.publish, self.state.version)
        replayed = await self._replay_log()
        self.metrics.write(event="resume", step=self.state.version, consumed=len(self.consumed),
                           replayed=replayed, checkpoint=self.resume or None)

    async def take_over(self, trained: list[int]) -> None:
        """This rank leads a group whose leader died with its inbox: the log gives back what was not trained."""
        self.ingest.consumed.update(trained)
        replayed = await self._replay_log()
        self.metrics.write(event="take_over", step=self.state.version, trained=len(trained), replayed=replayed)

    async def _replay_log(self) -> int:
        """Every logged experience of a prompt not trained yet goes to the inbox (which keeps the first copy of
        each sample); returns how many were read."""
        log = ExperienceLogReader(Path(self.worker.plan.run_dir) / "experience_log")
        consumed = self.ingest.consumed
        replay = [e for e in log if e.prompt_id not in consumed and e.model in self.cfg.names]
        for i in range(0, len(replay), MAX_INGEST_BATCH):
            self.ingest.add_many(replay[i:i + MAX_INGEST_BATCH])
            await asyncio.sleep(0)
        self.worker.inbox.changed.set()
        return len(replay)

    def broker_restarted(self, restarts: int) -> None:
        """A new broker: once it has our subscription, the log holds whatever the old one never routed to us."""
        if self.sub is not None:
            self.rejoin = asyncio.create_task(self._rejoin_broker(restarts))

    async def _rejoin_broker(self, restarts: int) -> None:
        try:
            await self.sub.resubscribe(self.cfg.timeouts.worker_start_s)
        except TimeoutError as exc:
            print(f"[{self.worker.id}] {self.model_name}: {exc}", file=sys.stderr, flush=True)
            return
        before = len(self.ingest.seen)
        replayed = await self._replay_log()
        self.metrics.write(event="broker_replay", step=self.state.version, restarts=restarts, read=replayed,
                           recovered=len(self.ingest.seen) - before)

    async def _listen(self) -> None:
        while True:  # what has arrived meanwhile comes as one batch: its peer completions cross the THL together
            msgs = await self.sub.recv_batch(MAX_INGEST_BATCH)
            if not msgs:  # the broker closed: the run is ending, no peer experience will come
                return
            self.ingest.add_many([m for m in msgs if isinstance(m, Experience)])
            self.worker.inbox.changed.set()

    def log_scalars(self, step: int, record: dict) -> None:
        if self.tb is not None:
            self.tb.scalars(step, record)

    def check(self) -> None:
        self.worker.check_listener()
        if self.sub is not None and self.listener.done():
            self.listener.result()  # never train on a dead inbox

    def alive_peers(self) -> list[str]:
        return [p for p in self.peers if p not in self.worker.inbox.gone]

    def announce_gone(self) -> None:
        """Say once, at the first step trained without it, that (and why) a peer is gone, and if it comes back."""
        gone = self.worker.inbox.gone
        for peer in sorted(self.announced - set(gone)):
            self.announced.discard(peer)
            print(f"[{self.model_name}] peer {peer} is back: waiting for its groups again", file=sys.stderr, flush=True)
            self.metrics.write(event="peer_back", step=self.state.version, peer=peer)
        for peer in newly_gone(gone, self.announced, self.peers, self.state.version, self.cfg.train.steps):
            why = gone[peer]
            self.announced.add(peer)
            left = self.alive_peers()
            how = "solo" if not left else f"with {', '.join(left)} only"
            print(f"[{self.model_name}] peer {peer} sends no more experience ({why}): training {how} from step "
                  f"{self.state.version + 1}", file=sys.stderr, flush=True)
            self.metrics.write(event="peer_gone", step=self.state.version, peer=peer, reason=why, training=how)

    def close(self) -> None:
        if self.sub is not None:
            self.listener.cancel()
            self.sub.close()
            self.writer.close()
            self.metrics.close()
            if self.tb is not None:
                self.tb.close()
            self.sub = None
