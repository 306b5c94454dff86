"""One failure policy for every run: what happens when a process dies or a learner group breaks.

- A generator (or idle worker) that dies is written off: its work units go back to the
  front of the queue, and a fresh worker process takes its device and role
  (``pool.max_respawns`` per run).
- A learner rank that dies leaves its group, which re-forms from the survivors (rank 0's
  state is sent to every rank again); a fresh worker joins the group as a new rank. If the
  dead rank led the group, its inbox is lost: the new leader refills its own from the
  experience log, every experience of a prompt the model has not trained (the formation
  names the trained ones), as a resumed run does; nothing is generated again.
- A model whose last learner rank dies is restarted on a fresh worker from its newest
  checkpoint (``run.checkpoint_every``), the experience log replaying what that checkpoint
  had not trained; the n-th restart of a model waits ``pool.restart_backoff_s * 2**(n-1)``
  first. With no checkpoint yet or no respawn left (``pool.max_respawns``) it leaves the
  run: its peers train solo and say so, and the run ends ``FAILED``.
- With ``train.sharding = "fsdp2"``, a formation of several ranks holds the state only in shards: a rank
  that dies, or a collective that fails, loses it. The surviving ranks then form again from the model's
  newest checkpoint (the dead rank's replacement joins them), the log replaying what it had not trained;
  with no checkpoint yet the model leaves the run.
- A group whose collective failed with nobody dead is re-formed as it was, at most
  ``MAX_BREAKS`` times in a row; then the model leaves the run.
- A broker that dies is started again on the same endpoints and log (``pool.max_broker_restarts``
  times): publishers re-send what it never confirmed (it refuses ids it logged already),
  and each leader re-subscribes and replays the log for what never reached it. Past the
  bound, or if the new broker does not come up, the run ends.

Every case is one line on stderr and one metrics record (``worker_lost``, ``learner_restart``,
``broker_restart``, ``model_left``). A worker killed by SIGKILL while memory was short
(``engine.runtime.memory``) is named a likely out-of-memory kill, with what lowers the run's memory
(``worker_lost`` has ``cause`` "oom").
"""

from __future__ import annotations

import asyncio
import sys

from engine.runtime.hub import restart_broker
from engine.runtime.memory import MemoryWatch, lower_it
from engine.runtime.plane import BrokerBack, GroupBroken
from engine.record.rundir import write_pids
from engine.train import checkpoint

SHARDS_LOST = "sharded state lost"  # how a broken fsdp2 formation's GroupBroken reason begins (roles.learner)
SHARDS_GONE = ("a sharded group cannot re-form from its survivors (the lost shards of the weights and AdamW "
               "moments are gone); set run.checkpoint_every to restart from a checkpoint inside the run")
DEATH_NOTICE_S = 1.0  # a broken group waits this long for the watch to see a death that explains it
WATCH_EVERY_S = 0.2  # how often process liveness is polled
MAX_BREAKS = 3


class RunFailed(RuntimeError):
    """The run cannot go on; the message says which part failed."""


class FailurePolicy:
    def __init__(self, coordinator):
        self.c = coordinator
        self.left: dict[str, str] = {}  # models that left the run, and why
        self.lost: list[str] = []  # workers that died
        self.respawned: list[str] = []
        self.waiting_role: dict[str, tuple[str, str]] = {}  # replacement worker -> the role it takes on hello
        self.breaks: dict[str, int] = {}
        self.messages: list[str] = []  # why the run is FAILED
        self.fatal: str | None = None
        self.stop_now: str | None = None  # why the run stops cleanly now (a verifier raised), FAILED at its end
        self.aborted: int | None = None  # a second Ctrl-C/SIGTERM: every process killed, no finals awaited
        self.reward_errors_said = False
        self.broker_restarts = 0
        self.learner_restarts: dict[str, int] = {}
        self.memory = MemoryWatch(coordinator.cfg.run.memory_short_gib)  # what a SIGKILLed worker died beside
        self.oom: list[str] = []  # each likely out-of-memory kill, as said

    def fail(self, text: str) -> None:
        if text not in self.messages:
            self.messages.append(text)

    def reward_failed(self, text: str) -> None:
        """A verifier or a reward function raised or answered in the wrong shape (train.reward_errors = "stop"): the
        run stops as at its time limit (each leader checkpoints its last step and evaluates, calling only what
        decides a success), then ends FAILED with ``text`` (said once, there; other generators' reports of the same
        are dropped)."""
        if self.stop_now is None:
            self.stop_now = text
            self.fail(text)
            self.c.say('\nthe reward failed: stopping, each model checkpointing the step it reached '
                       '(train.reward_errors = "stop"; the error is below)')

    def judged(self, wid: str, done) -> None:
        """A unit's verifier time-outs and errors scored 0 (train.reward_errors = "zero"): counted in the metrics,
        the first error said once."""
        if done.verify_timeouts:
            self.c.metrics.write(event="verify_timeout", worker=wid, gen_model=done.model,
                                 completions=done.verify_timeouts)
        if done.reward_errors:
            self.c.metrics.write(event="reward_error", worker=wid, gen_model=done.model,
                                 completions=done.reward_errors, first=done.reward_error)
            if not self.reward_errors_said:
                self.reward_errors_said = True
                self.c.say(f"[run] {done.reward_error}; scored 0 (train.reward_errors = \"zero\"; every such "
                           "completion is counted in the metrics as reward_error)")

    async def watching(self, coro) -> None:
        """Run ``coro`` while watching every process; a fatal death cancels it and raises RunFailed."""
        work = asyncio.create_task(coro)
        self.watch = watch = asyncio.create_task(self._watch())  # keeps watching through the halt
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            watch.result()  # a bug in the watch is loud
            raise RunFailed(self.fatal or "the watch ended")
        work.result()
        if self.fatal:
            raise RunFailed(self.fatal)

    async def _watch(self) -> None:
        seen: set[str] = set()
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self.memory.sample()
            if self.aborted:  # killed as asked: no death is news, no broker comes back
                continue
            for name, actor in list(self.c.actors.items()):
                if actor.alive or name in seen:
                    continue
                seen.add(name)
                if name == "broker":
                    if await self._broker_died(actor.exitcode):
                        seen.discard(name)
                        continue
                    self.c.changed.set()
                    return
                role = self.c.roster.assignment.get(name, ("idle", ""))
                if self.c.stopping and (actor.exitcode == 0 or role[0] != "learner" or role[1] in self.c.finals):
                    continue  # halted as asked
                await self._worker_died(name, actor.exitcode, actor.local)

    def _how_it_ended(self, code: int | None, local: bool) -> tuple[str, str]:
        """How a process ended, said after its name, and the advice that ends its line ("" unless memory was short).
        Only this machine's memory is watched: a death on another node is said by its exit code."""
        oom = self.memory.killed_short(code) if local else None
        if oom is None:
            return f"exited with code {code}", ""
        return oom, f" (lower the run's memory: {lower_it(self.c.cfg)})"

    def oom_note(self) -> str:
        """The out-of-memory kills so far, for a failure they may explain (a run that then made no progress)."""
        return f" (after {'; '.join(self.oom)})" if self.oom else ""

    async def _worker_died(self, wid: str, code: int | None, local: bool = True) -> None:
        c = self.c
        sharded = self._sharded_formation(c.roster.assignment.get(wid, ("idle", "")))
        role, led, messages = c.roster.remove(wid, c.trained)
        self.lost.append(wid)
        units = c.dispatch.lost(wid)
        what = f"{role[0]} of {role[1]}" if role[1] else role[0]
        ended, advice = self._how_it_ended(code, local)
        if advice:
            self.oom.append(f"{wid} ({what}) {ended}")
        c.metrics.write(event="worker_lost", worker=wid, role=role[0], gen_model=role[1], exitcode=code,
                        retaken_prompts=[p for u in units for p in u.prompt_ids], **({"cause": "oom"} if advice else {}))
        if role[0] == "learner" and not c.roster.groups[role[1]].members:
            restarted = None if c.stopping else self._restart_learner(wid, role[1])
            print(f"[run] {wid} ({what}) {ended}" + (restarted or "") + advice, file=sys.stderr, flush=True)
            if restarted is None:
                await self.model_leaves(role[1], f"its last learner rank {wid} {ended}")
            return
        if c.stopping:
            return
        if sharded:  # the survivors' shards are no state to re-form from: the group restarts from its checkpoint
            replacement = self._respawn(wid, role)
            await self._restart_sharded(role[1], f"{wid} ({what}) {ended}{advice}", replacement)
            return
        action = f"{len(units)} unit(s) go back to the queue" if role[0] != "learner" else \
            f"its group re-forms with {', '.join(c.roster.groups[role[1]].members)}"
        if led:
            lost_inbox = set(c.dispatch.done_prompts[role[1]]) - c.trained[role[1]]
            action += f", whose new leader takes the {len(lost_inbox)} prompts it held untrained from the log"
        replacement = self._respawn(wid, role)
        print(f"[run] {wid} ({what}) {ended}: {action}; "
              + (f"{replacement} takes its place" if replacement else
                 f"the run goes on with {len(c.roster.assignment)} workers") + advice, file=sys.stderr, flush=True)
        await c.send_all(messages)
        c.dispatch_all()

    async def _broker_died(self, code: int | None) -> bool:
        """Start a new broker on the same endpoints and log; False (and ``fatal`` set) if the run must end."""
        ended, advice = self._how_it_ended(code, True)
        c, why = self.c, f"the broker {ended}{advice}" if advice else f"the broker {ended} while the run was going"
        if c.stopping or self.broker_restarts >= c.cfg.pool.max_broker_restarts:
            self.fatal = why + ("" if c.stopping else f" (pool.max_broker_restarts={self.broker_restarts} used)")
            print(f"[run] {self.fatal}", file=sys.stderr, flush=True)
            return False
        self.broker_restarts += 1
        print(f"[run] {why}: restarting it on its endpoints and log ({self.broker_restarts} of "
              f"{c.cfg.pool.max_broker_restarts})", file=sys.stderr, flush=True)
        try:
            c.actors["broker"] = await restart_broker(c.hub, c.cfg.timeouts.worker_start_s)
        except TimeoutError as exc:
            self.fatal = f"{why}, and the new one did not come up: {exc}"
            print(f"[run] {self.fatal}", file=sys.stderr, flush=True)
            return False
        write_pids(c.run_dir, c.actors.values())
        c.metrics.write(event="broker_restart", exitcode=code, restarts=self.broker_restarts)
        for w in c.roster.assignment:
            await c.plane.send(w, BrokerBack(self.broker_restarts))
        return True

    def _restart_learner(self, dead: str, model: str) -> str | None:
        """A model's last learner died: a fresh worker restarts it from its newest checkpoint, and the
        experience log gives back what that checkpoint had not trained. None if no checkpoint or respawn is left."""
        c = self.c
        path = checkpoint.latest(c.run_dir, model)
        if path is None or len(self.respawned) >= c.cfg.pool.max_respawns or model in self.left:
            return None
        step = checkpoint.read_state(path)["step"]
        c.dispatch.steps[model] = step  # rewound: the steps after the checkpoint are trained again
        new = f"w{len(c.place_of)}"
        n = self.learner_restarts[model] = self.learner_restarts.get(model, 0) + 1
        delay = c.cfg.pool.restart_backoff_s * 2 ** (n - 1)  # a learner that keeps dying is not respawned in a tight loop
        self.respawned.append(new)
        self.waiting_role[new] = ("learner", model)
        c.place_of[new] = c.place_of[dead]  # the name is taken from now on
        asyncio.get_running_loop().call_later(delay, self._spawn_late, new, c.place_of[dead], model, str(path))
        c.metrics.write(event="learner_restart", gen_model=model, worker=new, step=step, checkpoint=str(path),
                        attempt=n, backoff_s=delay)
        return f": {new} restarts {model}'s learner from its step-{step} checkpoint in {delay:g}s, replaying the log"

    async def _restart_sharded(self, model: str, why: str, replacement: str | None = None) -> None:
        """A sharded formation lost its state: its surviving ranks form again from the newest checkpoint
        (the experience log gives back what it had not trained); the model leaves the run if there is none."""
        c = self.c
        path = checkpoint.latest(c.run_dir, model)
        if path is None:
            print(f"[run] {why}", file=sys.stderr, flush=True)
            await self.model_leaves(model, f"its sharded learner group lost its state and it has no checkpoint yet: "
                                           f"{SHARDS_GONE}")
            return
        step = checkpoint.read_state(path)["step"]
        c.dispatch.steps[model] = step  # rewound: the steps after the checkpoint are trained again
        messages = c.roster.reform(model, restore=str(path))
        members = c.roster.groups[model].members
        c.metrics.write(event="learner_restart", gen_model=model, worker=",".join(members), step=step,
                        checkpoint=str(path), sharded=True)
        print(f"[run] {why}: {model}'s sharded group ({', '.join(members)}) restarts from its step-{step} "
              f"checkpoint, replaying the log" + (f"; {replacement} takes the dead rank's place" if replacement else ""),
              file=sys.stderr, flush=True)
        await c.send_all(messages)
        c.dispatch_all()

    def _spawn_late(self, wid: str, place: tuple[int, int], model: str, path: str) -> None:
        if not self.c.stopping and model not in self.left:
            self.c.spawn_worker(wid, place, resume={model: path})

    def _respawn(self, dead: str, role: tuple[str, str]) -> str | None:
        c = self.c
        if len(self.respawned) >= c.cfg.pool.max_respawns or role[0] == "idle" or role[1] in self.left:
            return None
        new = f"w{len(c.place_of)}"
        c.spawn_worker(new, c.place_of[dead])
        self.respawned.append(new)
        self.waiting_role[new] = role
        return new

    async def hello(self, wid: str) -> None:
        """A replacement worker is up: it takes the role of the one it replaces."""
        role = self.waiting_role.pop(wid, None)
        if role is not None and role[1] not in self.left and not self.c.stopping:
            await self.c.apply({wid: role}, f"{wid} replaces a worker that died")

    async def model_leaves(self, model: str, why: str) -> None:
        c = self.c
        self.left[model] = why
        c.dispatch.leave(model)
        c.allocator.freeze(f"{model} left the run")
        stayed = [m for m in c.names if m not in self.left]
        self.fail(f"{model} left the run: {why}")
        c.metrics.write(event="model_left", gen_model=model, reason=why, training_on=stayed)
        if not stayed:
            self.fatal = "every model left the run"
            c.changed.set()
            return
        print(f"[run] {model} leaves the run ({why}); {', '.join(stayed)} "
              f"{'trains' if len(stayed) == 1 else 'train'} without it", file=sys.stderr, flush=True)
        idle = {w: ("idle", "") for w, (r, m) in c.roster.assignment.items() if m == model}
        c.set_gone()
        if idle and not c.stopping:
            await c.apply(idle, f"{model} left the run")

    def _sharded_formation(self, role: tuple[str, str]) -> bool:
        """Whether ``role`` is a rank of a formation whose state is sharded over several ranks."""
        group = self.c.roster.groups.get(role[1])
        return (role[0] == "learner" and self.c.cfg.train.sharding == "fsdp2" and group is not None
                and len(group.members) > 1)

    async def broken(self, msg: GroupBroken) -> None:
        group = self.c.roster.groups.get(msg.model)
        if group is None or msg.epoch != group.epoch or msg.model in self.left:
            return
        asyncio.create_task(self._reform_later(msg.model, msg.epoch, msg.reason))

    async def _reform_later(self, model: str, epoch: int, reason: str) -> None:
        await asyncio.sleep(DEATH_NOTICE_S)
        c = self.c
        if c.roster.groups[model].epoch != epoch or model in self.left or c.stopping:
            return  # a death re-formed it already
        self.breaks[model] = self.breaks.get(model, 0) + 1
        if self.breaks[model] > MAX_BREAKS:
            await self.model_leaves(model, f"its learner group failed {MAX_BREAKS} times in a row: {reason}")
            return
        if reason.startswith(SHARDS_LOST):
            await self._restart_sharded(model, f"{model}'s sharded learner group broke with every rank alive ({reason})")
            return
        print(f"[run] {model}'s learner group broke with every rank alive ({reason}); re-forming it",
              file=sys.stderr, flush=True)
        await c.send_all(c.roster.reform(model))

    def stepped(self, model: str) -> None:
        self.breaks.pop(model, None)
