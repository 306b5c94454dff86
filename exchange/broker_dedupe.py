"""Refusing a re-sent experience in bounded memory: ``RecentIds``, the experience ids a broker has logged
lately, and ``logged_ids``, which reads them back from an existing experience log when a broker (re)starts.

A broker that died is started again on the same log: the ids it holds already are refused
(``Stats.duplicate_total``), so what a publisher re-sends because no broker confirmed it is
logged and routed once.
"""

from __future__ import annotations

from exchange.log import ExperienceLogReader
from exchange.protocol import Experience


class RecentIds:
    """Recent experience ids, for refusing re-sends in bounded memory: at least the newest
    ``limit // 2``, at most ``limit`` (two generations of sets: the older is dropped when the newer fills).

    A publisher re-sends only what a broker never confirmed (``Publisher.keep_unconfirmed_bytes`` a
    publisher, 16 MB by default), so only recent ids can come again; a run of millions of
    experiences would otherwise hold every id for its whole length."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self._new: set[str] = set()
        self._old: set[str] = set()

    def first_seen(self, messages: list) -> list[int]:
        """The indices of ``messages`` that are not an Experience already seen (each is remembered now)."""
        keep = []
        new, old, half = self._new, self._old, self.half
        for i, m in enumerate(messages):
            if type(m) is Experience:
                eid = m.experience_id
                if eid in new or eid in old:
                    continue
                new.add(eid)
                if len(new) >= half:
                    self._old, self._new = old, new = new, set()
            keep.append(i)
        return keep


def logged_ids(log_dir: str, limit: int) -> RecentIds:
    """The newest ids of the experience log in ``log_dir`` (see ``RecentIds`` for how many are kept)."""
    ids = RecentIds(limit)
    for e in ExperienceLogReader(log_dir):
        ids.first_seen([e])
    return ids
