"""A worker: one process, one device, one role at a time (generator of m, learner rank of m, idle).

The worker obeys the coordinator's ``Order``s (``engine.runtime.plane``). A role changes
only at a boundary: a generator finishes the unit it is on and hands back any unit it
holds but has not started; a learner rank leaves when its group's leader ends the
formation. At that boundary the worker first releases what the new role does not reuse,
then the new role takes its memory (``_switch_to``, then ``acquired``): the old learner
state (module, gradients, AdamW moments) and the old generator backend go before the new
ones are built, as a GPU needs. Only the module of the same model survives a generator
<-> learner switch. Each switch is one ``role_switch`` line of metrics.jsonl.

Devices: with ``pool.device = "cuda"`` worker i is GPU ``i % device_count`` and every
module it builds lives there.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import torch

from engine.config import ModelConfig, RunConfig, model_spec, run_task, tokenizer_cache
from engine.roles import generator, learner, learner_core
from engine.roles.plan import WorkerPlan
from engine.roles.memory import Policy, RoleSwitch, device_bytes, held_bytes, process_rss, release, still_alive
from exchange.records import MetricsWriter
from engine.train import group as dp
from engine.runtime.plane import (BrokerBack, GroupSpec, Halt, HandBack, Hello, Order, PeersGone, Regroup, Work,
                                  WorkerPlane, WorkUnit)
from exchange.publisher import Publisher
from policies.backend import HFBackend
from policies.lora import add_adapters, load_adapters
from policies.models import build_policy
from tokenbridge import load_tokenizer

RoleOf = tuple[str, str]  # (role, model); model "" for idle


def start_module(cfg: RunConfig, m: ModelConfig, tok, warm: str, resume: str | None) -> torch.nn.Module:
    """A model as its RL starts: the warm start, or the checkpoint of a resumed run. With LoRA, the warm
    start is the frozen base of every process, under adapters seeded alike everywhere or resumed."""
    if m.lora is None:
        return build_policy(model_spec(m, resume or warm), tok)
    seed = cfg.run.seed * 1000 + cfg.names.index(m.name)
    module = add_adapters(build_policy(model_spec(m, warm), tok), m.lora, seed)
    if resume:
        load_adapters(module, resume)
    return module


def worker_device(cfg: RunConfig, index: int) -> torch.device:
    if cfg.pool.device == "cuda":
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


class Inbox:
    """What the coordinator has said: newest order, newest regroup per model, work, gone peers, halt."""

    def __init__(self) -> None:
        self.order: Order | None = None
        self.regroups: dict[str, GroupSpec] = {}
        self.work: collections.deque[WorkUnit] = collections.deque()
        self.gone: dict[str, str] = {}
        self.halt = False
        self.halt_reason = ""
        self.changed = asyncio.Event()

    def newer_order(self, than: Order | None) -> bool:
        return self.order is not None and (than is None or self.order.assign.epoch > than.assign.epoch)

    async def wait(self, timeout: float | None = None) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass


class Worker:
    def __init__(self, plan: WorkerPlan):
        self.plan, self.id, self.cfg = plan, plan.worker_id, plan.config
        self.names = self.cfg.names
        self.task = run_task(self.cfg)
        self.inbox = Inbox()
        self.role_now: RoleOf | None = None  # set while a role runs (work for another role is handed back)
        self.t0 = time.time()
        self._tokenizers: dict[str, object] = {}  # model -> tokenizer (host memory, kept)
        self.policies: dict[str, Policy] = {}  # the current role's modules
        self.learners: dict[str, learner_core.LearnerCore] = {}  # model -> state, while this worker is its rank
        self.resume = dict(plan.resume)  # model -> checkpoint; a learner role takes its model's entry once
        self.backend = None  # the generator role's inference engine
        self.reader = None  # the generator role's end of the weight channel ...
        self.reader_model = ""  # ... for this model
        self.device = worker_device(self.cfg, plan.device_index)
        dp.set_nccl_failure_env()  # before any NCCL group: a dead peer raises in the survivor, as on gloo
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread; start() gives to_thread's threads the same
            torch.set_float32_matmul_precision("high")  # TF32 matmuls: fp32 learners at tensor-core speed
        self._role: RoleOf | None = None
        self._switch: RoleSwitch | None = None

    async def start(self) -> None:
        if self.device.type == "cuda":  # the current CUDA device is per thread: every to_thread thread takes ours
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(
                thread_name_prefix=f"{self.id}-cuda", initializer=torch.cuda.set_device, initargs=(self.device,)))
        self.plane = WorkerPlane(self.plan.plane, self.id, curve=self.plan.curve)
        self.pub = Publisher(self.plan.broker_in, curve=self.plan.curve)
        self.metrics = MetricsWriter(self.plan.run_dir, "engine")
        self.listener = asyncio.create_task(self._listen())
        self.listener.add_done_callback(lambda _: self.inbox.changed.set())
        await self.plane.send(Hello(self.id, os.getpid()))

    def close(self) -> None:
        self.listener.cancel()
        for core in self.learners.values():
            core.close()
        if self.backend is not None:
            self.backend.close()  # an sglang Engine's processes go with the worker
        self._end_generator(keep_module=False)
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
                if self.role_now == ("generator", msg.unit.model):
                    self.inbox.work.append(msg.unit)
                else:  # reassigned meanwhile: someone else generates it
                    await self.plane.send(HandBack(self.id, msg.unit))
            elif isinstance(msg, PeersGone):
                self.inbox.gone = dict(msg.gone)
            elif isinstance(msg, Halt):
                self.inbox.halt, self.inbox.halt_reason = True, msg.reason
            elif isinstance(msg, BrokerBack):
                for core in self.learners.values():
                    core.broker_restarted(msg.restarts)
            self.inbox.changed.set()

    def check_listener(self) -> None:
        if self.listener.done():
            self.listener.result()  # re-raise what killed it: never work on a dead inbox

    def policy(self, model: str) -> Policy:
        """A model's module as this worker holds it; one not held is built from the warm start (version 0),
        or in a resumed run from the checkpoint (its learner publishes that version before any work)."""
        if model not in self.policies:
            m = self.cfg.model(model)
            tok = self.tokenizer(model)
            resume = self.resume.get(model, self.plan.resume.get(model))  # a learner restarted in the run: its own
            module = start_module(self.cfg, m, tok, self.plan.warm_checkpoints[model], resume)
            module = module.to(self.device)
            self.policies[model] = Policy(tok, module)
        return self.policies[model]

    def tokenizer(self, model: str):
        """A model's tokenizer, loaded once a process (a load parses a few MB of JSON: each role, each peer's
        inbox and each role switch would otherwise load it again)."""
        if model not in self._tokenizers:
            self._tokenizers[model] = load_tokenizer(self.cfg.model(model).tokenizer, tokenizer_cache(self.cfg))
        return self._tokenizers[model]

    def plan_channel(self, model: str) -> Path:
        """The directory of ``model``'s weight channel."""
        return Path(self.plan.weights_root) / model

    async def pad_to_budget(self, kind: str, model: str, started: float, samples: int) -> None:
        """A modelled device (``pool.costs``) is busy for its budget: sleep out what real compute left of it."""
        budget = self.cfg.pool.cost(kind, model, started - self.t0) * samples
        await asyncio.sleep(max(0.0, started + budget - time.time()))

    # --- role switches: release the old role's memory, then take the new one's ---
    def _holdings(self) -> list:
        held: list = [p.module for p in self.policies.values()]
        held += [core.state.optimizer for core in self.learners.values()]
        held += [m for core in self.learners.values() if core.state.reference is not None
                 for m in core.state.reference.holdings()]
        held += [part for core in self.learners.values() if core.twin is not None for part in core.twin.holdings()]
        if isinstance(self.backend, HFBackend):  # an sglang backend holds its weights in sglang's own processes
            held.append(self.backend.model)
        return held

    def _switch_to(self, new: RoleOf) -> None:
        """Drop what ``new`` does not reuse and give the memory back, before ``new`` builds anything."""
        old, self._role = self._role, new
        if old is None or old == new:
            return  # the first role is no switch; the same role again keeps what it has
        started = time.time()
        before, dev_before, rss_before = held_bytes(*self._holdings()), device_bytes(self.device), process_rss()
        dropped, reused = self._drop_unreused(new)
        release()
        self._switch = RoleSwitch(
            worker=self.id, from_role=old[0], from_model=old[1], to_role=new[0], to_model=new[1], reused=reused,
            released_alive=still_alive(dropped), release_s=round(time.time() - started, 4),
            held_bytes_before=before, held_bytes_after_release=held_bytes(*self._holdings()),
            device_bytes_before=dev_before, device_bytes_after_release=device_bytes(self.device),
            rss_before=rss_before, rss_after_release=process_rss())
        if new[0] == "idle":
            self.acquired()  # idle takes nothing

    def _drop_unreused(self, new: RoleOf) -> tuple[list[weakref.ref], list[str]]:
        """Forget the old role's state; returns weak references to what was dropped, and what is kept.

        The generator backend always goes. A learner core goes with its gradients and AdamW
        state unless ``new`` is that same learner: that loses nothing, the group's other ranks
        hold the same state and a rank that joins later receives it from rank 0. A module is
        kept only for the same model's other role; the new role overwrites its weights anyway.
        """
        role, model = new
        keep = model if role in ("generator", "learner") else None
        dropped: list[weakref.ref] = []
        if self.backend is not None:
            self.backend.close()
            dropped.append(weakref.ref(self.backend))
            self.backend = None
        self._end_generator(keep_module=self.reader is not None and self.reader_model == keep)
        for m, core in list(self.learners.items()):
            if new == ("learner", m):
                continue
            del self.learners[m]
            core.close()
            dropped.append(weakref.ref(core.state.optimizer))
            if core.state.reference is not None:  # the KL term's frozen copy (none for LoRA: the module itself)
                dropped += [weakref.ref(m) for m in core.state.reference.holdings()]
            for p in core.module.parameters():
                p.grad = None  # gradients are the learner role's, even where the module stays
        for m in list(self.policies):
            if m != keep and m not in self.learners:
                dropped.append(weakref.ref(self.policies.pop(m).module))
        return dropped, [f"module:{m}" for m in self.policies] + [f"learner:{m}" for m in self.learners]

    def _end_generator(self, keep_module: bool) -> None:
        """Leave the weight channel; a module that stays gets private copies of its shared weights first."""
        if self.reader is not None:
            self.reader.close(detach=keep_module)
            self.reader = None

    def acquired(self) -> None:
        """The new role holds its memory now: measure, and write the switch's metrics line."""
        switch, self._switch = self._switch, None
        if switch is None:
            return
        switch.held_bytes_after_acquire = held_bytes(*self._holdings())
        switch.device_bytes_after_acquire = device_bytes(self.device)
        switch.rss_after_acquire = process_rss()
        self.metrics.write(event="role_switch", **msgspec.structs.asdict(switch))

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
                await generator.generate_role(self, order)
            elif role == "learner":
                await learner.learn_role(self, order.group)


async def run(payload: bytes) -> int:
    worker = Worker(msgspec.msgpack.decode(payload, type=WorkerPlan))
    await worker.start()
    try:
        await worker.main()
    finally:
        worker.close()
    return 0
