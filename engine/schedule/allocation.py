"""Integer max-min allocation of workers to pools, and the moves that get there.

A *pool* is one (role, model) pair, e.g. ("generator", "qwen-8b"). Every pool turns
workers into prompt groups per second at a per-worker rate (its *capacity*); a run's
useful rate is the slowest pool's rate, because a prompt counts only when every model
has generated and trained on it. These functions are pure and know nothing about
Stats or time: the controller (engine/schedule/controller.py) and the simulator's oracle
(benchmarks/) both call them.

Pools are identified by string keys ("generator:qwen-8b"); see ``pool_key``.
"""

from __future__ import annotations

import heapq
import math
from typing import Mapping

ROLES = ("generator", "learner")


def pool_key(role: str, model: str) -> str:
    return f"{role}:{model}"


def split_key(key: str) -> tuple[str, str]:
    role, _, model = key.partition(":")
    return role, model


def pool_rate(n: int, capacity: float, demand: float = 0.0) -> float:
    """Prompt groups per second a pool of n workers delivers beyond ``demand`` (a backlog to drain)."""
    return n * capacity - demand


def bottleneck_rate(counts: Mapping[str, int], capacity: Mapping[str, float],
                    demand: Mapping[str, float] | None = None) -> float:
    """The run's useful rate under ``counts``: the slowest pool's rate."""
    demand = demand or {}
    return min(pool_rate(counts[k], capacity[k], demand.get(k, 0.0)) for k in counts)


def max_min_counts(capacity: Mapping[str, float], total: int, minimum: Mapping[str, int],
                   maximum: Mapping[str, int], demand: Mapping[str, float] | None = None) -> dict[str, int]:
    """Counts per pool maximising the slowest pool's rate, with min/max per pool and sum <= total.

    Water-filling: start every pool at its minimum and give each further worker to the
    pool that is currently slowest (and below its maximum). For rates that grow with n,
    this greedy choice is optimal for the max-min objective: any allocation whose
    slowest rate exceeds the greedy one would need, in every pool, at least as many
    workers as greedy gave it at the moment that pool was last topped up. Spare workers
    (every pool at its maximum) are left out of the result's sum.
    """
    demand = demand or {}
    counts = {k: minimum[k] for k in capacity}
    spare = total - sum(counts.values())
    if spare < 0:
        raise ValueError(f"the per-pool minimums need {sum(counts.values())} workers but only {total} exist")
    heap = [(pool_rate(counts[k], capacity[k], demand.get(k, 0.0)), k) for k in sorted(capacity)
            if counts[k] < maximum[k]]
    heapq.heapify(heap)
    while spare > 0 and heap:
        _, k = heapq.heappop(heap)
        counts[k] += 1
        spare -= 1
        if counts[k] < maximum[k]:
            heapq.heappush(heap, (pool_rate(counts[k], capacity[k], demand.get(k, 0.0)), k))
    return counts


def plan_moves(current: Mapping[str, int], target: Mapping[str, int], capacity: Mapping[str, float],
               donors_available: Mapping[str, int], max_moves: int,
               demand: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """(from_pool, to_pool) moves that take ``current`` toward ``target``, most useful first.

    Each move takes a worker from the pool with the largest surplus (highest rate after
    losing one worker) among pools above target with a movable worker, and gives it to
    the slowest pool below target. At most ``max_moves`` moves; ``donors_available``
    says how many workers of each pool may move now (the dwell rule). The pool key
    "idle:" (free workers) may appear in ``current`` and is always the first donor.
    """
    demand = demand or {}
    counts = dict(current)
    movable = dict(donors_available)
    moves: list[tuple[str, str]] = []
    while len(moves) < max_moves:
        needy = [k for k in target if counts.get(k, 0) < target[k]]
        donors = [k for k in counts if counts[k] > target.get(k, 0) and movable.get(k, 0) > 0]
        if not needy or not donors:
            break
        to = min(needy, key=lambda k: (pool_rate(counts.get(k, 0), capacity[k], demand.get(k, 0.0)), k))
        frm = max(donors, key=lambda k: (math.inf if k not in capacity
                                         else pool_rate(counts[k] - 1, capacity[k], demand.get(k, 0.0)), k))
        counts[frm] -= 1
        counts[to] = counts.get(to, 0) + 1
        movable[frm] -= 1
        moves.append((frm, to))
    return moves
