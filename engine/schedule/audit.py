"""After a run: was any experience lost or duplicated, across reassignments and deaths?

Checked against the broker's experience log (``exchange.log.ExperienceLogReader``),
which records every Experience the broker accepted:

- every work unit a generator reported done has all of its G samples per prompt in the log;
- no (model, prompt, sample) appears twice (a handed-back unit is generated once), except
  in a unit taken back from a generator that died after publishing part of it: the
  replacement generates it whole, and the learners keep the first copy of each sample
  (``engine.train.ingest``). Those copies are counted as ``regenerated``, not as duplicates;
- every complete group in the log of a model still in the run was either trained by its
  learner group or is reported by the leader as still queued when the run ended.

Logged experiences no learner could accept (``engine.train.trust``: another run's id, a
group size or token id this run cannot have: what a hostile sender gets past the broker)
are counted as ``untrusted`` and take no part in the rest.
"""

from __future__ import annotations

import collections
from pathlib import Path

import msgspec

from engine.train.trust import untrusted
from exchange.log import ExperienceLogReader


class Audit(msgspec.Struct):
    logged: int  # experiences in the log
    duplicates: int
    regenerated: int  # second copies of samples in units re-issued after their generator died
    missing_from_log: int  # samples of units reported done that the log does not hold
    untrained_not_queued: int  # samples of complete logged groups neither trained nor queued at the end
    lost: int  # missing_from_log + untrained_not_queued
    untrusted: int = 0  # logged experiences no learner could accept (ignored above)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicates == 0


def audit_log(log_dir: Path, models: list[str], G: int, trained: dict[str, set[int]],
              queued: dict[str, list[int]], done_prompts: dict[str, list[int]],
              retaken: dict[str, set[int]] | None = None, run_id: str | None = None,
              vocab: dict[str, int] | None = None) -> Audit:
    seen: collections.Counter = collections.Counter()
    bad = 0
    for exp in ExperienceLogReader(log_dir):
        if vocab is not None and untrusted(exp, run_id, G, vocab) is not None:
            bad += 1
            continue
        seen[(exp.model, exp.prompt_id, exp.sample_index)] += 1
    per_group: collections.Counter = collections.Counter()
    for (model, prompt, _), _n in seen.items():
        per_group[(model, prompt)] += 1
    missing = 0
    for m in models:
        missing += sum(max(G - per_group[(m, p)], 0) for p in done_prompts.get(m, []))
    queued_sets = {m: set(ids) for m, ids in queued.items()}
    untrained = sum(n for (m, p), n in per_group.items()
                    if m in models and n >= G and p not in trained.get(m, ()) and p not in queued_sets.get(m, ()))
    retaken = retaken or {}
    extra = {key: c - 1 for key, c in seen.items() if c > 1}
    regenerated = sum(n for (m, p, _), n in extra.items() if p in retaken.get(m, ()))
    dup = sum(extra.values()) - regenerated
    return Audit(logged=sum(seen.values()), duplicates=dup, regenerated=regenerated, missing_from_log=missing,
                 untrained_not_queued=untrained, lost=missing + untrained, untrusted=bad)
