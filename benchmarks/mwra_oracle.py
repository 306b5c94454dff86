"""The oracle static split: the best fixed allocation, searched exhaustively with pruning.

A static split gives every pool k (role, model) a fixed n_k workers. Split the run
into S consecutive segments of blocks; segment s needs C[s, k] GPU-seconds from pool k
(the simulator's own sampled block costs, so the oracle sees exactly the work the
simulator runs). With perfect pipelining and no switching, the run takes

    T(n) = sum_s max_k C[s, k] / n_k

(each segment goes at its slowest pool's pace; buffering between segments is bounded
by the staleness window, a few blocks out of thousands). ``best_static_split``
minimises T over EVERY integer split with sum n_k = N and the per-pool bounds, by
branch and bound: pools are fixed one at a time, and a partial split is pruned when
the lower bound

    sum_s max( max_{fixed k} C[s,k]/n_k ,  sum_{free j} C[s,j] / (workers left) )

(the second term is the best any split of the remaining workers can do in segment s)
cannot beat the incumbent. That bound is exact for the relaxation, so the search
returns the true optimum; ``brute_force_split`` checks it in the tests on small N.
"""

from __future__ import annotations

import itertools

import numpy as np


def run_time(C: np.ndarray, n: np.ndarray) -> float:
    """Fluid run time of split ``n``: C is (S, K) GPU-seconds, n is (K,) workers."""
    return float(np.max(C / n[None, :], axis=1).sum())


def dynamic_run_time(C: np.ndarray, total: int) -> float:
    """Fluid run time if every segment had its own best (fractional) split, free to switch."""
    return float(C.sum(axis=1).sum() / total)


def _incumbent(C: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A good feasible split: proportional to total work, then pairwise-move local search."""
    share = C.sum(axis=0) / C.sum()
    n = np.clip(np.floor(share * total).astype(int), lo, hi)
    while n.sum() < total:
        free = np.flatnonzero(n < hi)
        gains = [run_time(C, n + np.eye(len(n), dtype=int)[k]) for k in free]
        n[free[int(np.argmin(gains))]] += 1
    while n.sum() > total:
        spare = np.flatnonzero(n > lo)
        losses = [run_time(C, n - np.eye(len(n), dtype=int)[k]) for k in spare]
        n[spare[int(np.argmin(losses))]] -= 1
    best = run_time(C, n)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.permutations(range(len(n)), 2):
            if n[a] - 1 < lo[a] or n[b] + 1 > hi[b]:
                continue
            m = n.copy()
            m[a] -= 1
            m[b] += 1
            t = run_time(C, m)
            if t < best - 1e-12:
                n, best, improved = m, t, True
    return n


def best_static_split(C: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, float, int]:
    """(split, fluid run time, nodes visited) of the exact best static split."""
    S, K = C.shape
    if lo.sum() > total or hi.sum() < total:
        raise ValueError(f"no split of {total} workers meets the per-pool bounds")
    order = np.argsort(-C.sum(axis=0))  # big pools first: their choice prunes most
    Co, lo_o, hi_o = C[:, order], lo[order], hi[order]
    inc = _incumbent(C, total, lo, hi)
    best = [run_time(C, inc), inc[order].copy()]
    nodes = [0]
    suffix = np.concatenate([np.cumsum(Co[:, ::-1], axis=1)[:, ::-1], np.zeros((S, 1))], axis=1)  # (S, K+1)
    lo_suffix = np.concatenate([np.cumsum(lo_o[::-1])[::-1], [0]])
    hi_suffix = np.concatenate([np.cumsum(hi_o[::-1])[::-1], [0]])

    def search(d: int, fixed: list[int], part_max: np.ndarray, left: int) -> None:
        nodes[0] += 1
        if d == K - 1:
            if lo_o[d] <= left <= hi_o[d]:
                t = float(np.maximum(part_max, Co[:, d] / left).sum())
                if t < best[0] - 1e-12:
                    best[0], best[1] = t, np.array(fixed + [left])
            return
        cand_lo = max(lo_o[d], left - hi_suffix[d + 1])
        cand_hi = min(hi_o[d], left - lo_suffix[d + 1])
        if cand_lo > cand_hi:
            return
        cand = np.arange(cand_lo, cand_hi + 1)  # (n_cand,)
        pm = np.maximum(part_max[None, :], Co[None, :, d] / cand[:, None])  # (n_cand, S)
        rest = suffix[None, :, d + 1] / (left - cand)[:, None]
        bound = np.maximum(pm, rest).sum(axis=1)
        for i in np.argsort(bound):
            if bound[i] >= best[0] - 1e-12:
                break
            search(d + 1, fixed + [int(cand[i])], pm[i], left - int(cand[i]))

    search(0, [], np.zeros(S), total)
    split = np.empty(K, dtype=int)
    split[order] = best[1]
    return split, best[0], nodes[0]


def brute_force_split(C: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, float]:
    """Every split, one by one: for checking ``best_static_split`` on small N."""
    K = C.shape[1]
    best_t, best_n = np.inf, None
    for head in itertools.product(*(range(lo[k], hi[k] + 1) for k in range(K - 1))):
        last = total - sum(head)
        if not lo[-1] <= last <= hi[-1]:
            continue
        n = np.array(head + (last,))
        t = run_time(C, n)
        if t < best_t - 1e-12:
            best_t, best_n = t, n
    return best_n, best_t
