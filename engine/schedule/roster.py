"""Who holds which role, and each model's learner group: the coordinator's bookkeeping, no I/O.

Every change returns the messages to send (``(worker, message)`` pairs), so the rules are
in one place:
- a move that touches a learner group re-forms it (a new epoch, a fresh endpoint); its old
  members hear ``Regroup``, its new members get the group in their ``Order``;
- a group's leader (rank 0) never moves while its group exists: a move that names it is
  given to another member of the same pool, which is the same to the allocator and keeps
  the leader's inbox in place. A leader that dies is replaced by the next member.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from engine.runtime.plane import GroupSpec, Order, Regroup
from engine.record.rundir import free_port
from exchange.protocol import SCHEMA_VERSION, Assign

RoleOf = tuple[str, str]


def _loopback(worker: str) -> str:
    return "127.0.0.1"


class Roster:
    def __init__(self, models: list[str], host_of=_loopback):
        self.models = models
        self.host_of = host_of  # worker -> the address of its machine (where a group's rank 0 serves its rendezvous)
        self.assignment: dict[str, RoleOf] = {}
        self.groups: dict[str, GroupSpec] = {}
        self.seq = 0  # Assign epochs: a worker ignores an order older than the one it holds
        self.regroups = 0
        self.restoring: dict[str, str] = {}  # model -> the checkpoint its formations start from until one formed
        self.taking_over: dict[str, list[int]] = {}  # model -> prompts trained when its leader died, until one formed
        self.t0 = 0.0  # the RL phase's start (the cost model's clock), sent with every order

    def start(self, initial: dict[str, RoleOf], t0: float) -> list[tuple[str, object]]:
        self.t0 = t0
        self.assignment = dict(initial)
        for m in self.models:
            self.groups[m] = GroupSpec(m, 1, self._endpoint(self.members(m)), self.members(m))
        return self._orders(initial, "initial split")

    def _endpoint(self, members: list[str]) -> str:
        """A fresh rendezvous on the machine of the group's rank 0 (a port free on the coordinator's: on another
        machine it may be taken, and the formation then fails and re-forms on another)."""
        host = self.host_of(members[0]) if members else "127.0.0.1"
        return f"tcp://{'[' + host + ']' if ':' in host else host}:{free_port()}"

    def members(self, model: str) -> list[str]:
        return sorted(w for w, rm in self.assignment.items() if rm == ("learner", model))

    def leader(self, model: str) -> str | None:
        group = self.groups.get(model)
        return group.members[0] if group and group.members else None

    def apply(self, changes: dict[str, RoleOf], reason: str, moved_at: Mapping[str, float] | None = None
              ) -> tuple[dict[str, RoleOf], list[tuple[str, object]]]:
        """Take the moves in ``changes`` (leaders swapped for stand-ins, the longest settled by ``moved_at``: worker ->
        when it last changed role); returns what changed and what to send."""
        changes = self._keep_leaders(changes, moved_at or {})
        changes = {w: rm for w, rm in changes.items() if self.assignment.get(w) != rm}
        if not changes:
            return {}, []
        old = {m: g.members for m, g in self.groups.items()}
        self.assignment.update(changes)
        out: list[tuple[str, object]] = []
        for m in self.models:
            new = [w for w in old[m] if self.assignment.get(w) == ("learner", m)]
            new += sorted(w for w, rm in changes.items() if rm == ("learner", m) and w not in old[m])
            if new != old[m]:
                out += self._reform(m, new, tell=old[m])
        return changes, out + self._orders(changes, reason)

    def remove(self, worker: str, trained: dict[str, set[int]] | None = None
               ) -> tuple[RoleOf, bool, list[tuple[str, object]]]:
        """A worker died: (its role, whether it led its group, the regroup messages for the survivors); ``trained``:
        each model's trained prompts, which the survivors' next leader needs if this worker led."""
        role = self.assignment.pop(worker, ("idle", ""))
        if role[0] != "learner":
            return role, False, []
        members = self.groups[role[1]].members
        led = bool(members) and members[0] == worker
        if led and trained is not None:  # the next leader opens a fresh inbox: the log refills it
            self.taking_over[role[1]] = sorted(trained.get(role[1], ()))
        survivors = [w for w in members if w != worker]
        return role, led, self._reform(role[1], survivors, tell=survivors)

    def reform(self, model: str, restore: str = "") -> list[tuple[str, object]]:
        """The same members again, as a new formation (after a collective failed with nobody dead); ``restore``:
        from that checkpoint."""
        members = self.groups[model].members
        if restore:
            self.restoring[model] = restore
        return self._reform(model, members, tell=members)

    def formed(self, model: str, epoch: int, rank: int) -> None:
        """Rank 0 of a formation reports its state: a restore it carried has happened."""
        if rank == 0 and self.groups[model].epoch == epoch:
            self.restoring.pop(model, None)
            self.taking_over.pop(model, None)

    def _reform(self, model: str, members: list[str], tell: list[str]) -> list[tuple[str, object]]:
        # a restore or a take-over is carried by every formation until one has formed: a later one may overtake it
        group = GroupSpec(model, self.groups[model].epoch + 1, self._endpoint(members), members,
                          self.restoring.get(model, ""), self.taking_over.get(model))
        self.groups[model] = group
        self.regroups += 1
        return [(w, Regroup(group)) for w in tell]

    def _keep_leaders(self, changes: dict[str, RoleOf], moved_at: Mapping[str, float]) -> dict[str, RoleOf]:
        out = dict(changes)
        for m, group in self.groups.items():
            leader = group.members[0] if group.members else None
            if leader in out and out[leader] != ("learner", m):
                target = out.pop(leader)
                stand_ins = [w for w in group.members[1:] if w not in out]
                if stand_ins:  # the one longest in its role (a move costs a reload); of equals, the last member
                    out[min(reversed(stand_ins), key=lambda w: moved_at.get(w, -math.inf))] = target
        return out

    def _orders(self, changes: dict[str, RoleOf], reason: str) -> list[tuple[str, object]]:
        self.seq += 1
        out = []
        for w, (role, model) in sorted(changes.items()):
            assign = Assign(schema=SCHEMA_VERSION, epoch=self.seq, worker_id=w, role=role, model=model, reason=reason)
            out.append((w, Order(assign, self.t0, self.groups[model] if role == "learner" else None)))
        return out

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r, m in self.assignment.values():
            counts[f"{r}:{m}"] = counts.get(f"{r}:{m}", 0) + 1
        return counts
