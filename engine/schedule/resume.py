"""Where a resumed run starts: each model's newest checkpoint, and which work is owed again.

Read before the broker reopens the experience log. For model m, with C the prompts its
checkpoint had trained and L the prompts of which the log holds any of m's samples:

- every logged sample of a prompt outside C is replayed to m's learner (``LearnerCore._resume``),
  so a complete logged group is trained once and never generated again;
- every prompt of an issued step (up to the newest step in C or L) that is not in C and
  not complete in the log is handed out again, the partly logged ones as re-generations
  (the learner keeps the first copy of a sample; the audit counts the rest as regenerated);
- the dispatcher continues after the newest issued step;
- the workers take the roles they had (``allocation.json``, see ``engine.schedule.allocator``).
"""

from __future__ import annotations

import collections
import sys

from exchange.records import MetricsWriter
from engine.train import checkpoint
from exchange.log import ExperienceLogReader


def resume_plan(coord) -> dict[str, str]:
    """Set up ``coord`` (a Coordinator) to continue its run; returns model -> checkpoint to start from, "" for a
    model stopped before its first checkpoint (it starts from the warm start, and its learner replays the log
    all the same)."""
    cfg, run_dir, dispatch = coord.cfg, coord.run_dir, coord.dispatch
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    log_dir = run_dir / "experience_log"
    if log_dir.is_dir():
        for exp in ExperienceLogReader(log_dir):
            counts[(exp.model, exp.prompt_id)] += 1
    start: dict[str, str] = {}
    metrics = MetricsWriter(run_dir, "engine")
    for m in cfg.names:
        path = checkpoint.latest(run_dir, m)
        step, consumed = 0, set()
        if path is not None:
            state = checkpoint.read_state(path)
            step, consumed = state["step"], set(state["consumed"])
        start[m] = str(path) if path is not None else ""
        logged = {p: n for (model, p), n in counts.items() if model == m}
        owed = dispatch.resume(m, step, consumed, logged)
        coord.trained[m].update(consumed)
        replay = sum(n for p, n in logged.items() if p not in consumed)
        where = f"step {step} ({path})" if path is not None else "the warm start (no checkpoint yet)"
        print(f"[resume] {m}: from {where}; {replay} logged samples to replay, {len(owed)} prompts to generate "
              "again", file=sys.stderr, flush=True)
        metrics.write(event="resume", gen_model=m, step=step, checkpoint=start[m] or None, replay_samples=replay,
                      regenerate_prompts=len(owed))
    said = coord.allocator.recall()
    print(f"[resume] {said}", file=sys.stderr, flush=True)
    metrics.write(event="resume_allocation", restored=bool(coord.allocator.recalled), why=said)
    metrics.close()
    return start
