"""A batch split by prompt groups into pieces (as ranks and micro-batches split a step) gives the
whole batch's gradient when every piece divides by the step's denominators (policies.denominators),
for every registered objective and both aggregations; scaling each piece's own mean does not."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from policies.batch import ObjectiveBatch
from policies.denominators import SITES, given_totals, local_counts
from policies.objectives import SGTConfig, compute_loss, get_objective, objective_names
from test_objectives_reference import grads, random_batch

OWN_ROWS = ("logp", "behav_logp", "prox_logp", "mask", "rewards", "group", "staleness", "verified", "ref_logp")
PEER_ROWS = ("peer_logp", "peer_behav_logp", "peer_mask", "peer_rewards", "peer_group", "peer_verified",
             "peer_residual", "peer_align", "peer_staleness", "peer_source_len", "peer_capability")


def piece(b: ObjectiveBatch, groups: list[int]) -> ObjectiveBatch:
    """The rows of ``b`` on ``groups`` (group ids kept: the objectives read them per group)."""
    own, peer = torch.isin(b.group, torch.tensor(groups)), torch.isin(b.peer_group, torch.tensor(groups))
    rows = {n: getattr(b, n)[own] for n in OWN_ROWS if getattr(b, n) is not None}
    rows |= {n: getattr(b, n)[peer] for n in PEER_ROWS if getattr(b, n) is not None}
    return dataclasses.replace(b, **rows)


def rescue_batch(seed: int) -> ObjectiveBatch:
    """A random batch with rescue groups 0 and 1 (own all fail, one verified fresh peer each: a forced draw)."""
    b = random_batch(seed, B=12, P=8, Q=4)
    b.staleness.zero_()
    b.peer_staleness.zero_()
    b.verified[:] = b.group == 2
    b.peer_verified[:] = False
    b.own_capability, b.peer_capability = 0.3, torch.linspace(0.1, 0.9, b.num_peers, dtype=b.peer_rewards.dtype)
    b.peer_source_len = b.peer_mask.sum(dim=1).long() + torch.arange(b.num_peers) % 3  # another vocabulary's
    for q in (0, 1):
        rows = (b.peer_group == q).nonzero().flatten()
        if rows.numel():
            b.peer_verified[rows[0]] = True
    return b


def split_grads(b: ObjectiveBatch, cfg, pieces: list[list[int]], exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed gradients of the pieces' losses: over the step's denominators, or (old) own mean x share of groups."""
    parts = [piece(b, groups) for groups in pieces]
    totals = given_totals(sum(local_counts(p, cfg, torch.Generator().manual_seed(0)) for p in parts))
    out = [torch.zeros_like(b.logp), torch.zeros_like(b.peer_logp)]
    for groups, p in zip(pieces, parts):
        if exact:
            loss = compute_loss(dataclasses.replace(p, totals=totals), cfg, torch.Generator().manual_seed(0))[0]
        else:
            loss = compute_loss(p, cfg, torch.Generator().manual_seed(0))[0] * len(groups) / b.num_groups
        out = [a + g for a, g in zip(out, grads(loss, b))]
    return out[0], out[1]


def configs() -> list:
    out = []
    for name in objective_names():
        config_type, _ = get_objective(name)
        for aggregation in ("token_mean", "seq_mean"):
            try:
                out.append(msgspec.convert({"aggregation": aggregation, "kl_coef": 0.05}, config_type))
            except msgspec.ValidationError:  # an objective with one aggregation (HACPO: the sequence mean)
                continue
    return out + [SGTConfig(nll_norm="sum", lam=0.7)]


@pytest.mark.parametrize("cfg", configs(), ids=lambda c: f"{c.kind}-{c.aggregation}")
@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_over_the_steps_denominators_sum_to_the_whole_batch(cfg, seed):
    b = rescue_batch(seed)
    whole = grads(compute_loss(b, cfg, torch.Generator().manual_seed(0))[0], b)
    pieces = [[0, 3], [1, 2]]  # group 3 has no rows: one piece is a single group's
    for got, want in zip(split_grads(b, cfg, pieces, exact=True), whole):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    old = split_grads(b, cfg, pieces, exact=False)
    assert max(float((o - w).abs().max()) for o, w in zip(old, whole)) > 1e-4, "the batch must show the old scaling's error"


def test_the_sites_and_counts_recorded():
    b, cfg = rescue_batch(0), SGTConfig(kl_coef=0.1)
    counts = dict(zip(SITES, local_counts(b, cfg, torch.Generator().manual_seed(0)).tolist()))
    fresh = b.mask * (b.staleness <= cfg.max_staleness)[:, None]
    _, stats = compute_loss(b, cfg, torch.Generator().manual_seed(0))
    assert counts == {"own": float(fresh.sum()), "kl": float(fresh.sum()), "pooled": 0.0,
                      "rescued": stats["rescue_set_size"], "rows": 0.0} and counts["rescued"] == 2
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    local_counts(b, cfg, g)
    assert torch.equal(g.get_state(), before), "counting does not advance the step's RNG"
