"""Learner actor: own + peer experience in, optimizer steps, weights out.

- Own and peer experience arrive on ``exp.<model>`` topics; peer completions go
  through the THL (retokenized into this model's vocabulary) as they arrive.
- A step takes the ``prompts_per_step`` oldest complete own groups. Objectives
  that use peers wait for the peers' groups on those prompts at most
  ``peer_deadline_s``, then use what has arrived and count the misses.
- A peer that stops (it finished its steps, or the supervisor took it out of the
  run after a crash) is no longer waited for: the learner says once, on stderr and
  in metrics.jsonl, that it trains without it, and every step record says ``solo``.
- Samples older than the objective's ``max_staleness`` are masked by the
  objective and counted; after each step the new weights are staged for the
  generators (``WeightSender``, never blocking) and announced (``WeightsReady``).
"""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec
import torch

from engine import weightsync
from engine.config import tokenizer_cache
from engine.batching import PeerSample, build_batch
from engine.evaluation import evaluate
from engine.generator import ready_stats
from engine.ingest import Ingest
from engine.metrics import MetricsWriter
from engine.plan import WorkerPlan
from engine.optim import adamw
from exchange.protocol import SCHEMA_VERSION, Control, Experience, Stats, WeightsReady
from exchange.transport import Publisher, Subscriber
from policies.backend import HFBackend
from policies.models import build_policy, save_policy
from policies.objectives import compute_loss
from tasks.registry import make_task
from tokenbridge import load_tokenizer


async def run(payload: bytes) -> int:
    plan = WorkerPlan.decode(payload)
    learner = Learner(plan)
    await learner.start()
    try:
        await learner.train()
    finally:
        learner.close()
    return 0


class Learner:
    def __init__(self, plan: WorkerPlan):
        self.plan = plan
        cfg, spec = plan.config, plan.model
        self.cfg, self.spec = cfg, spec
        cache = tokenizer_cache(cfg)
        self.tokenizer = load_tokenizer(spec.tokenizer, cache)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model = build_policy(msgspec.structs.replace(spec, checkpoint=plan.warm_checkpoint), self.tokenizer)
        self.model.train()
        lr = spec.lr or cfg.train.lr
        self.optimizer = adamw(self.model.parameters(), lr=lr, betas=cfg.train.adam_betas)
        self.task = make_task(cfg.task)
        peers = {m.name: load_tokenizer(m.tokenizer, cache) for m in cfg.models if m.name != spec.name}
        self.ingest = Ingest(spec, self.tokenizer, peers, self.task, cfg.train.group_size)
        self.metrics = MetricsWriter(plan.run_dir, spec.name)
        self.rng = torch.Generator().manual_seed(cfg.run.seed * 1000 + plan.model_index)
        self.version = 0
        self.peer_version: dict[str, int] = {name: 0 for name in peers}
        self.peer_done: dict[str, str] = {}  # peer -> why it sends no more experience
        self.peer_announced: set[str] = set()
        self.stop_requested = False
        self.arrived = asyncio.Event()
        self.started = time.time()
        self.totals = {"own_experiences": 0, "peer_experiences": 0, "peer_used": 0, "peer_misses": 0,
                       "staleness_dropped": 0}

    async def start(self) -> None:
        plan = self.plan
        names = [m.name for m in self.cfg.models]
        self.sub = Subscriber(plan.broker_out, topics=[*(f"exp.{n}" for n in names), "weights.", "ctl"],
                              name=plan.worker_id)
        self.pub = Publisher(plan.broker_in)
        await self.sub.ready()
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: self.arrived.set())  # wake train() to see a failure
        world = 1 + self.spec.generators
        await asyncio.to_thread(weightsync.init_group, plan.weight_group, 0, world, self.cfg.train.weight_sync_timeout_s)
        self.sender = weightsync.WeightSender(self.model, shm_slots=weightsync.data_plane(plan.weight_group, self.model))
        await self.pub.send(ready_stats(plan))
        self.metrics.write(event="start", step=0, weight_version=0, **plan.warm_eval)

    def close(self) -> None:
        self.listener.cancel()
        self.sender.close()
        self.sub.close()
        self.pub.close()
        self.metrics.close()

    async def _listen(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg, Experience):
                self.ingest.add(msg)
            elif isinstance(msg, WeightsReady) and msg.model in self.peer_version:
                self.peer_version[msg.model] = max(self.peer_version[msg.model], msg.version)
                if msg.step >= self.cfg.train.steps:
                    self.peer_done.setdefault(msg.model, f"finished its {msg.step} steps")
            elif isinstance(msg, Control) and msg.command == "stop" and msg.target in ("*", self.spec.name):
                self.stop_requested = True
            elif isinstance(msg, Control) and msg.command == "stop" and msg.target in self.peer_version:
                self.peer_done.setdefault(msg.target, msg.reason or "stopped")
            self.arrived.set()

    async def _wait(self, predicate, timeout: float | None = None) -> bool:
        """Wait until predicate() or stop or timeout; True if predicate holds."""
        deadline = None if timeout is None else time.time() + timeout
        while not predicate():
            if self.listener.done():
                self.listener.result()  # re-raise what killed the listener: never train on a dead inbox
            if self.stop_requested:
                return False
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                return False
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=left)
            except TimeoutError:
                pass
        return True

    async def train(self) -> None:
        train = self.cfg.train
        Q = train.prompts_per_step
        while self.version < train.steps and not self.stop_requested:
            t_wait = time.time()
            if not await self._wait(lambda: self.ingest.complete_own_groups() >= Q):
                break
            prompts = self.ingest.next_own_groups(Q)
            peer_wait = 0.0
            alive = lambda: [m for m in self.peer_version if m not in self.peer_done]
            if self.cfg.objective.kind != "grpo":
                t_peer = time.time()
                await self._wait(lambda: self.ingest.peers_complete(prompts, alive()), train.peer_deadline_s)
                peer_wait = time.time() - t_peer
            idle = time.time() - t_wait
            self._announce_gone_peers()
            own, peers, misses = self.ingest.take(prompts, alive())
            record = await asyncio.to_thread(self._step, prompts, own, peers, misses)
            record.update(idle_s=round(idle, 4), peer_wait_s=round(peer_wait, 4),
                          solo=bool(self.peer_version) and not alive(), peers_gone=sorted(self.peer_done))
            await self._after_step(record)
        await self._finish()

    def _announce_gone_peers(self) -> None:
        """Say once per peer, at the first step trained without it, that (and why) it is gone."""
        for peer, why in self.peer_done.items():
            if peer in self.peer_announced:
                continue
            self.peer_announced.add(peer)
            left = [m for m in self.peer_version if m not in self.peer_done]
            how = "solo" if not left else f"with {', '.join(left)} only"
            print(f"[{self.spec.name}] peer {peer} sends no more experience ({why}): training {how} from step "
                  f"{self.version + 1}", file=sys.stderr, flush=True)
            self.metrics.write(event="peer_gone", step=self.version, peer=peer, reason=why, training=how)

    def _step(self, prompts: list[int], own: list, peers_all: list[PeerSample], misses: int) -> dict:
        t0 = time.time()
        peers = self._peers_for_objective(own, peers_all)
        batch = build_batch(self.model, own, peers, prompts, self.version, self.pad_id, self.peer_version)
        loss, stats = compute_loss(batch, self.cfg.objective, self.rng)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self._set_lr()
        self.optimizer.step()
        self.version += 1
        rewards = [s.reward for s in own]
        self.totals["own_experiences"] += len(own)
        self.totals["peer_experiences"] += len(peers_all)
        self.totals["peer_used"] += len(peers)
        self.totals["peer_misses"] += misses
        self.totals["staleness_dropped"] += int(stats.get("staleness_dropped", 0))
        return dict(
            step=self.version, weight_version=self.version, reward_mean=sum(rewards) / max(len(rewards), 1),
            solve_rate=sum(s.verified for s in own) / max(len(own), 1),
            staleness_mean=sum(self.version - 1 - s.weight_version for s in own) / max(len(own), 1),
            thl_residual_mean=(sum(p.residual for p in peers_all) / len(peers_all)) if peers_all else None,
            thl_failures=self.ingest.failures, peer_late=self.ingest.late,
            peer_batch=len(peers_all), grad_norm=float(grad_norm), step_s=round(time.time() - t0, 4),
            **self.totals, **{f"obj/{k}": float(v) for k, v in stats.items()},
        )

    def _peers_for_objective(self, own, peers: list[PeerSample]) -> list[PeerSample]:
        kind = self.cfg.objective.kind
        if kind == "grpo":
            return []
        if kind == "xgrpo":  # only scalars cross: drop the tokens so no forward pass is spent on them
            return [self.ingest.scalars_only(p) for p in peers]
        if kind == "sgt":  # only verified successes on prompts where every own sample failed can matter
            failed = {pid for pid in {s.prompt_id for s in own}
                      if not any(s.verified for s in own if s.prompt_id == pid)}
            return [p for p in peers if p.verified and p.prompt_id in failed]
        return peers

    def _set_lr(self) -> None:
        warm = self.cfg.train.warmup_steps
        scale = min(1.0, (self.version + 1) / warm) if warm > 0 else 1.0
        base = self.spec.lr or self.cfg.train.lr
        for group in self.optimizer.param_groups:
            group["lr"] = base * scale

    async def _after_step(self, record: dict) -> None:
        try:
            self.sender.publish(self.version)
        except weightsync.WeightSyncError as exc:
            # A generator is gone (the supervisor takes this model out of the run): keep what was learned.
            print(f"[{self.spec.name}] {exc}: stopping; the checkpoint and final evaluation follow",
                  file=sys.stderr, flush=True)
            self.stop_requested = True
        else:
            await self.pub.send(WeightsReady(schema=SCHEMA_VERSION, model=self.spec.name, version=self.version,
                                             step=self.version, nbytes=self.sender.nbytes, time=time.time()))
        ev = self.cfg.eval
        if ev.every_steps and self.version % ev.every_steps == 0 and self.version < self.cfg.train.steps:
            result = await asyncio.to_thread(self._evaluate, ev.live_problems)
            record.update(accuracy=result.accuracy, accuracy_stderr=result.stderr)
        self.metrics.write(event="step", **record)
        await self.pub.send(Stats(
            schema=SCHEMA_VERSION, worker_id=self.plan.worker_id, role="learner", model=self.spec.name,
            time=time.time(), window_s=record["step_s"] + record["idle_s"],
            consumed_per_s=len(self.ingest.last_popped) / max(record["step_s"] + record["idle_s"], 1e-9),
            queue_depth=self.ingest.queued_own(), idle_frac=record["idle_s"] / max(record["step_s"] + record["idle_s"], 1e-9),
            staleness_mean=record["staleness_mean"], peer_wait_s=record["peer_wait_s"], weight_version=self.version,
        ))

    def _evaluate(self, n: int):
        ev = self.cfg.eval
        self.model.eval()
        try:
            backend = HFBackend(self.model, eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.pad_id)
            return evaluate(backend, self.tokenizer, self.spec.arch, self.task, n,
                            temperature=ev.temperature, batch_size=ev.batch_size,
                            max_new_tokens=self.cfg.train.max_new_tokens)
        finally:
            self.model.train()

    async def _finish(self) -> None:
        ckpt = f"{self.plan.run_dir}/checkpoints/{self.spec.name}"
        await asyncio.to_thread(save_policy, self.model, self.tokenizer, ckpt)
        result = await asyncio.to_thread(self._evaluate, self.cfg.eval.num_problems)
        self.metrics.write(
            event="final", step=self.version, weight_version=self.version,
            accuracy=result.accuracy, accuracy_stderr=result.stderr, eval_n=result.n,
            wall_s=round(time.time() - self.started, 2), checkpoint=ckpt, warm_checkpoint=self.plan.warm_checkpoint,
            stopped_early=self.stop_requested,
            **self.plan.warm_eval, **self.totals,
        )
