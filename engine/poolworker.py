"""A pool worker: one process, one stand-in GPU, one role at a time.

The worker obeys ``Order``s from the coordinator (``engine.pool``). Roles:

- generator of model m: pulls prompt batches (``WantWork`` -> ``Work``), generates
  with the engine's generator code (``engine.generator._generate``), pads the batch
  to its cost (the compute budget), publishes the Experience to the broker. Weights
  come from the model's ``WeightStore`` between batches, never inside one.
- learner rank of model m: ``engine.poollearner.learn_role``.
- idle.

A role changes only at a step boundary: a generator finishes the batch it is on and
hands back (``HandBack``) any batch it holds but has not started; a learner leaves
when its group's leader ends the formation (``dataparallel.REGROUP``).

At that boundary the worker first releases what the new role does not reuse, then
takes the new role's memory (``Worker._switch_to``, then ``Worker.acquired``): the old
learner state (module, gradients, AdamW moments) and the old generator backend and
module go before the new ones are built, as a GPU would need. Only the module of the
same model survives a generator <-> learner switch. Each switch is one ``role_switch``
line of metrics.jsonl with the bytes held before, after the release and after the
new role took its memory.

Devices: with ``pool.device = "cuda"`` worker i is GPU ``i % device_count``
(``poolconfig.worker_device``). Every module the worker builds goes there, the
generator backend samples there, and ``role_switch`` lines carry the CUDA allocator's
figures (``device_bytes_*``). Weights cross processes as CPU tensors in files
(``WeightStore``), and learner collectives stage through CPU (``engine.dataparallel``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
import weakref
from pathlib import Path

import msgspec
import torch

from engine.config import RunConfig, tokenizer_cache
from engine.dataparallel import params_digest
from engine.generator import _generate
from engine.metrics import MetricsWriter
from engine.plan import WorkerPlan
from engine.poolconfig import PoolConfig, worker_device
from engine.poolplane import (BatchDone, GroupSpec, Halt, HandBack, Hello, Order, Regroup, WantWork, Work,
                              WorkerPlane)
from engine.rolememory import RoleSwitch, device_bytes, held_bytes, release, still_alive
from exchange.protocol import SCHEMA_VERSION, PromptBatch, Stats
from exchange.transport import Publisher
from policies.backend import HFBackend
from policies.models import build_policy
from tasks.registry import make_task
from tokenbridge import load_tokenizer


class PoolWorkerPlan(msgspec.Struct, frozen=True):
    worker_id: str
    index: int
    run_id: str
    run_dir: str
    config: RunConfig
    pool: PoolConfig
    broker_in: str
    broker_out: str
    plane: str
    warm_checkpoints: list[str]  # per model, in config.models order


class WeightStore:
    """Newest weights of each model as files: the leader writes, generators read between batches.

    Generators join and leave all the time in a pool, so a broadcast group per model
    would re-form on every move; a file per version (written to a temp name, then
    renamed, so a reader never sees half a file) needs no membership at all.
    """

    def __init__(self, run_dir: str, model: str):
        self.dir = Path(run_dir) / "pool" / "weights" / model
        self.dir.mkdir(parents=True, exist_ok=True)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Write ``model``'s parameters as version ``version``; the file holds CPU tensors whatever the device."""
        from safetensors.torch import save_file

        tensors = {f"p{i:04d}": p.detach().contiguous().cpu() for i, p in enumerate(model.parameters())}
        tmp = self.dir / f".{version:08d}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.dir / f"{version:08d}.safetensors")
        for old in sorted(self.dir.glob("*.safetensors"))[:-3]:
            old.unlink(missing_ok=True)

    def newest(self) -> int:
        files = sorted(self.dir.glob("*.safetensors"))
        return int(files[-1].stem) if files else 0

    def load(self, model: torch.nn.Module, version: int) -> bool:
        """Copy version ``version`` into ``model``'s parameters in place, on whatever device they live."""
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(self.dir / f"{version:08d}.safetensors"))
        except FileNotFoundError:
            return False  # pruned meanwhile: the caller tries the newest again next batch
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(tensors[f"p{i:04d}"])
        return True


class Inbox:
    """What the coordinator has said: newest order, newest regroup per model, work, halt."""

    def __init__(self) -> None:
        self.order: Order | None = None
        self.regroups: dict[str, GroupSpec] = {}
        self.work: collections.deque[PromptBatch] = collections.deque()
        self.halt = False
        self.changed = asyncio.Event()

    def newer_order(self, than: Order | None) -> bool:
        return self.order is not None and (than is None or self.order.assign.epoch > than.assign.epoch)

    async def wait(self, timeout: float | None = None) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass


Role = tuple[str, str]  # (role, model); model is "" for idle


class Worker:
    def __init__(self, plan: PoolWorkerPlan):
        self.plan, self.id, self.cfg, self.pool = plan, plan.worker_id, plan.config, plan.pool
        self.names = [m.name for m in self.cfg.models]
        self.task = make_task(self.cfg.task)
        self.inbox = Inbox()
        self.role_now: tuple[str, str] | None = None
        self.t0 = time.time()
        self._tokenizers: dict[str, object] = {}  # model -> tokenizer (host memory, kept)
        self._policies: dict[str, list] = {}  # model -> [tokenizer, module, weight version held]; current role's only
        self.learners: dict[str, object] = {}  # model -> poollearner.LearnerCore, while this worker is its rank
        self.backend: HFBackend | None = None  # the generator role's inference engine
        self.device = worker_device(plan.pool, plan.index)  # where the modules live (device_bytes measures there)
        if self.device.type == "cuda":
            # the current device is per thread: to_thread's threads start on cuda:0, so tensors name theirs
            torch.cuda.set_device(self.device)
        self._role: Role | None = None  # the role taken last (None before the first order)
        self._switch: RoleSwitch | None = None  # released, waiting for the new role to take its memory

    async def start(self) -> None:
        self.plane = WorkerPlane(self.plan.plane, self.id)
        self.pub = Publisher(self.plan.broker_in)
        self.metrics = MetricsWriter(self.plan.run_dir, "mwra")
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: self.inbox.changed.set())
        await self.plane.send(Hello(self.id, os.getpid()))

    def close(self) -> None:
        self.listener.cancel()
        for core in self.learners.values():
            core.close()
        self.pub.close()
        self.plane.close()
        self.metrics.close()

    async def _listen(self) -> None:
        while True:
            msg = await self.plane.recv()
            if isinstance(msg, Order):
                self.inbox.order, self.t0 = msg, msg.t0
            elif isinstance(msg, Regroup):
                known = self.inbox.regroups.get(msg.group.model)
                if known is None or msg.group.epoch > known.epoch:
                    self.inbox.regroups[msg.group.model] = msg.group
            elif isinstance(msg, Work):
                if self.role_now == ("generator", msg.batch.model):
                    self.inbox.work.append(msg.batch)
                else:  # reassigned meanwhile: someone else generates it
                    await self.plane.send(HandBack(self.id, msg.batch))
            elif isinstance(msg, Halt):
                self.inbox.halt = True
            self.inbox.changed.set()

    def check_listener(self) -> None:
        if self.listener.done():
            self.listener.result()  # re-raise what killed it: never work on a dead inbox

    def policy(self, model: str) -> list:
        """[tokenizer, module, version] of a model; a module not held is built from the warm start (version 0)."""
        if model not in self._policies:
            i = self.names.index(model)
            spec = self.cfg.models[i]
            if model not in self._tokenizers:
                self._tokenizers[model] = load_tokenizer(spec.tokenizer, tokenizer_cache(self.cfg))
            tok = self._tokenizers[model]
            module = build_policy(msgspec.structs.replace(spec, checkpoint=self.plan.warm_checkpoints[i]), tok)
            self._policies[model] = [tok, module.to(self.device), 0]
        return self._policies[model]

    # --- role switches: release the old role's memory, then take the new one's ---
    def _holdings(self) -> list:
        """Everything of a role this worker references: modules (weights, grads), optimizers (moments)."""
        held: list = [entry[1] for entry in self._policies.values()]
        held += [core.state.optimizer for core in self.learners.values()]
        if self.backend is not None:
            held.append(self.backend.model)
        return held

    def _switch_to(self, new: Role) -> None:
        """Drop what ``new`` does not reuse and give the memory back, before ``new`` builds anything."""
        old, self._role = self._role, new
        if old is None or old == new:
            return  # the first role is no switch; the same role again keeps what it has
        started = time.time()
        before, dev_before = held_bytes(*self._holdings()), device_bytes(self.device)
        dropped, reused = self._drop_unreused(new)
        release()
        self._switch = RoleSwitch(
            worker=self.id, from_role=old[0], from_model=old[1], to_role=new[0], to_model=new[1], reused=reused,
            released_alive=still_alive(dropped), release_s=round(time.time() - started, 4),
            held_bytes_before=before, held_bytes_after_release=held_bytes(*self._holdings()),
            device_bytes_before=dev_before, device_bytes_after_release=device_bytes(self.device))
        if new[0] == "idle":
            self.acquired()  # idle takes nothing

    def _drop_unreused(self, new: Role) -> tuple[list[weakref.ref], list[str]]:
        """Forget the old role's state; returns weak references to what was dropped, and what is kept.

        - The generator backend always goes (an engine with its own weights and KV pool,
          such as sglang, would be shut down here).
        - A learner core goes with its gradients and AdamW state unless ``new`` is that same
          learner. That loses nothing: the group's other ranks hold the same state, and a
          rank that joins later receives all of it from rank 0 (``dataparallel.sync_state``).
          Rank 0 never leaves while its group exists (``engine.pool._keep_leaders``).
        - A module is kept only for the same model's other role (generator <-> learner rank):
          its weights are the model's, and the new role overwrites them anyway (the learner
          from rank 0, the generator from the WeightStore).
        """
        role, model = new
        dropped: list[weakref.ref] = []
        if self.backend is not None:
            dropped.append(weakref.ref(self.backend))
            self.backend = None
        for m, core in list(self.learners.items()):
            if new == ("learner", m):
                continue
            if core.sub is not None:  # the leader's inbox: cannot happen (leaders never move); never lose it
                print(f"[pool] {self.id}: keeping {m}'s learner state, it holds the group's inbox", file=sys.stderr)
                continue
            del self.learners[m]
            core.close()
            dropped.append(weakref.ref(core.state.optimizer))
            for p in core.module.parameters():
                p.grad = None  # gradients are the learner role's, even where the module stays
        keep = model if role in ("generator", "learner") else None
        for m in list(self._policies):
            if m != keep and not any(c.model_name == m for c in self.learners.values()):
                dropped.append(weakref.ref(self._policies.pop(m)[1]))
        return dropped, [f"module:{m}" for m in self._policies] + [f"learner:{m}" for m in self.learners]

    def acquired(self) -> None:
        """The new role holds its memory now: measure, and write the switch's metrics line."""
        switch, self._switch = self._switch, None
        if switch is None:
            return
        switch.held_bytes_after_acquire = held_bytes(*self._holdings())
        switch.device_bytes_after_acquire = device_bytes(self.device)
        self.metrics.write(event="role_switch", **msgspec.structs.asdict(switch))

    def cost_s(self, kind: str, model: str, started: float, samples: int) -> float:
        return self.pool.cost(kind, model, started - self.t0) * samples

    async def main(self) -> None:
        done: Order | None = None
        while True:
            while not self.inbox.halt and not self.inbox.newer_order(done):
                self.check_listener()
                await self.inbox.wait()
            if self.inbox.halt:
                return
            done = order = self.inbox.order
            role = order.assign.role
            self._switch_to((role, order.assign.model if role != "idle" else ""))
            if role == "generator":
                await self._generate_role(order)
            elif role == "learner":
                from engine.poollearner import learn_role

                await learn_role(self, order.group)

    async def _generate_role(self, order: Order) -> None:
        model = order.assign.model
        tok, module, _ = entry = self.policy(model)
        store = WeightStore(self.plan.run_dir, model)
        self.backend = backend = HFBackend(module, eos_token_id=tok.eos_token_id,
                                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                                           else tok.eos_token_id, device=self.device)
        await _load_newest(store, entry)  # a module rebuilt from the warm start never generates as version 0
        self.acquired()
        plan = WorkerPlan(run_id=self.plan.run_id, run_dir=self.plan.run_dir, config=self.cfg,
                          model_index=self.names.index(model), role="generator", worker_index=self.plan.index,
                          broker_in=self.plan.broker_in, broker_out=self.plan.broker_out, weight_group="",
                          warm_checkpoint=self.plan.warm_checkpoints[self.names.index(model)])
        self.role_now = ("generator", model)
        asked, checked, idle, window_start = False, False, 0.0, time.time()
        try:
            while not self.inbox.halt and not self.inbox.newer_order(order):
                if not self.inbox.work:
                    if not asked:
                        await self.plane.send(WantWork(self.id, model))
                        asked = True
                    t = time.time()
                    self.check_listener()
                    await self.inbox.wait()
                    idle += time.time() - t
                    continue
                batch, asked = self.inbox.work.popleft(), False
                started = time.time()  # the batch's budget covers loading the newest weights too
                await _load_newest(store, entry)
                exps = await asyncio.to_thread(_generate, plan, backend, tok, self.task, batch, entry[2], started)
                await asyncio.sleep(max(0.0, started + self.cost_s("gen", model, started, len(exps)) - time.time()))
                for exp in exps:
                    await self.pub.send(exp)
                await self.pub.flush()
                digest = "" if checked else params_digest(module)
                checked = True
                await self.plane.send(BatchDone(self.id, model, batch.batch_id, [p.prompt_id for p in batch.problems], len(exps),
                                                     entry[2], digest))
                window = time.time() - window_start
                await self.pub.send(Stats(
                    schema=SCHEMA_VERSION, worker_id=self.id, role="generator", model=model, time=time.time(),
                    window_s=window, samples_per_s=len(exps) / window, idle_frac=idle / window,
                    tokens_per_s=sum(len(e.completion_ids) // 4 for e in exps) / window, weight_version=entry[2]))
                idle, window_start = 0.0, time.time()
        finally:
            self.role_now = None
            while self.inbox.work:  # started batches are finished above; unstarted ones go back
                await self.plane.send(HandBack(self.id, self.inbox.work.popleft()))


async def _load_newest(store: WeightStore, entry: list) -> None:
    """Bring ``entry``'s module to the newest published version; ``entry[2]`` says which it holds.

    A file pruned between ``newest`` and ``load`` means a newer one exists: try that.
    """
    while (newest := store.newest()) > entry[2]:
        if await asyncio.to_thread(store.load, entry[1], newest):
            entry[2] = newest


async def run(payload: bytes) -> int:
    plan = msgspec.msgpack.decode(payload, type=PoolWorkerPlan)
    worker = Worker(plan)
    await worker.start()
    try:
        await worker.main()
    finally:
        worker.close()
    return 0
