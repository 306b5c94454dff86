"""A loss's denominators over a whole step's batch, for a step computed in pieces (ranks, micro-batches).

Every objective is a mean: numerators add over any split of the step's prompts, denominators
do not (a token mean divides by the batch's token count, which no share knows). Each place
that normalises asks its batch for the denominator (``ObjectiveBatch.total(site, local)``,
one site name per place, ``SITES``); one process passes nothing and divides by its own count.
A step split into pieces:

1. ``local_counts`` runs the objective once per piece on a batch without a forward (zero
   log-probs: every denominator is a count of masks, staleness, groups and verified flags,
   never of log-probs) and records each site's count; ranks add their pieces' vectors and
   all-reduce the sum, one vector of ``len(SITES)`` for every rank (zeros for an empty share),
   so no collective runs inside an objective and none can be skipped by one rank;
2. ``given_totals(counts)`` is the ``totals`` of every piece's real batch: the piece's
   numerator over the step's denominator. The pieces' losses then add up to the whole batch's,
   and so do their gradients, to float rounding.

Recording the sites by running the objective itself keeps one definition of each count:
nothing here restates an objective's masks. SGT's uniform draw of one rescue per group is split
invariant too when the batch carries ``peer_draw`` keys (the engine's batches do: each row's key
hashes the step, its prompt and its place among that prompt's peers); a batch without them
draws from the objective's RNG, which a split reads differently.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import msgspec
import torch
from torch import Tensor

from policies.batch import ObjectiveBatch
from policies.registry import compute_loss

# own: the receiver's own tokens (rows for seq_mean); kl: the KL term's; pooled: own + peer tokens (PRP);
# rescued: SGT's rescue groups; rows: own + peer rows with a token (HACPO's sequence mean).
SITES = ("own", "kl", "pooled", "rescued", "rows")


def local_counts(batch: ObjectiveBatch, config: msgspec.Struct, rng: torch.Generator) -> Tensor:
    """(len(SITES),) float64: the denominator this batch alone would divide by at each site (0 where unused).

    ``batch``'s log-probs are not read for the counts; ``rng`` is not advanced (a copy is used)."""
    seen: dict[str, float] = {}

    def record(site: str, local: Tensor) -> Tensor:
        if site not in SITES:
            raise KeyError(f"normalising site {site!r} is not one of {SITES}: add it to policies.denominators.SITES")
        seen[site] = float(local)
        return local

    copy = torch.Generator(device=rng.device).set_state(rng.get_state())
    with torch.no_grad():
        compute_loss(dataclasses.replace(batch, totals=record), config, copy)
    return torch.tensor([seen.get(site, 0.0) for site in SITES], dtype=torch.float64)


def given_totals(counts: Tensor) -> Callable[[str, Tensor], Tensor]:
    """``ObjectiveBatch.totals`` answering each site with the step's count (``counts``, in ``SITES`` order)."""
    values = dict(zip(SITES, counts.tolist()))

    def total(site: str, local: Tensor) -> Tensor:
        return local.new_tensor(values[site])  # counts are whole numbers: exact in float32 below 2**24

    return total
