"""How a run ended: its result (``run_result.json``, with the audit of the experience log), the summary
printed for the user, the ``FAILED``/``INTERRUPTED`` markers, and the exit code."""

from __future__ import annotations

import signal
import sys

import msgspec

from engine.record.display import print_summary
from engine.record.rundir import mark
from engine.schedule.audit import Audit, audit_log


class RunResult(msgspec.Struct):
    duration_s: float  # the RL phase, from the first dispatch to the stop
    trained_prompts: int  # prompts every model still in the run trained on, the steps finished while stopping included
    useful_prompts: int  # of those, the ones trained within duration_s: the useful rate's count
    useful_samples: int
    useful_samples_per_s: float
    steps: dict[str, int]
    moves: int  # acted allocator decisions and scripted moves
    regroups: int
    handbacks: int
    lost_workers: list[str]
    respawned: list[str]
    left_the_run: dict[str, str]  # model -> why
    gen_busy_s: dict[str, float]  # per model: worker-seconds spent generating
    train_busy_s: dict[str, float]  # per model: seconds its leader spent in optimizer steps
    formations: list[dict]  # per group formation: epoch, step, digests of every rank (equal = bit-identical)
    timeline: list[dict]  # {"t": s, "counts": {pool: workers}}
    audit: Audit
    # per model, the share of completions cut at max_new_tokens (no EOS): "before" and "after" RL in the held-out
    # evaluations, "train" over its own samples of the last steps (engine.record.truncation); None: not measured
    truncated: dict[str, dict[str, float | None]] = {}


def prompts_trained_by_all(c) -> set[int]:
    """Prompts every model still in the run has trained on so far: taken at the stop for the useful rate (the
    steps learners finish while stopping come after duration_s), and at the end for trained_prompts."""
    stayed = [c.trained[m] for m in c.names if m not in c.failures.left]
    return set.intersection(*stayed) if stayed else set()


def vocab_sizes(c) -> dict[str, int] | None:
    """Each model's vocabulary size, as its warm start's process read it from the tokenizer (None before)."""
    sizes = {p.model: p.vocab_size for p in c.preps}
    return sizes if len(sizes) == len(c.names) else None


def write_result(c) -> RunResult:
    """run_result.json, with the audit of the experience log; a failed audit fails the run."""
    stayed = [m for m in c.names if m not in c.failures.left]
    audit = audit_log(c.run_dir / "experience_log", stayed, c.cfg.train.group_size, c.trained,
                      {m: f.queued_prompt_ids for m, f in c.finals.items()}, c.dispatch.done_prompts,
                      c.dispatch.retaken, c.run_dir.name, vocab_sizes(c))
    if hasattr(c, "display"):  # every final is in: their cut, and a short run's training window, judged once
        for m in c.names:
            if m in c.finals:
                c.display.cut.finished(c.finals[m])
    duration = max(c.t_stop - c.t_start, 1e-9)
    samples = len(c.useful) * c.cfg.train.group_size * len(stayed)
    result = RunResult(duration_s=round(duration, 2), trained_prompts=len(prompts_trained_by_all(c)),
                       useful_prompts=len(c.useful), useful_samples=samples,
                       useful_samples_per_s=samples / duration, steps=dict(c.dispatch.steps), moves=c.moves,
                       regroups=c.roster.regroups, handbacks=c.dispatch.handbacks,
                       lost_workers=c.failures.lost, respawned=c.failures.respawned,
                       left_the_run=dict(c.failures.left), gen_busy_s=c.busy["gen"],
                       train_busy_s=c.busy["train"],
                       formations=sorted(c.formations.values(), key=lambda r: (r["model"], r["epoch"])),
                       timeline=c.timeline, audit=audit, truncated=truncated(c))
    (c.run_dir / "run_result.json").write_bytes(msgspec.json.encode(result))
    if audit.duplicates or (audit.lost and not c.failures.aborted):  # (aborted: the log keeps them for a resume)
        c.failures.fail(f"the audit of the experience log found {audit.lost} lost and {audit.duplicates} "
                        "duplicated experiences")
    return result


def truncated(c) -> dict[str, dict[str, float | None]]:
    """RunResult.truncated: the warm starts' evaluations, the finals' and the live display's training window."""
    before, cut = {p.model: p.warm_truncated for p in c.preps}, train_cut(c)
    return {m: {"before": before.get(m), "after": c.finals[m].truncated if m in c.finals else None,
                "train": cut.get(m)} for m in c.names}


def train_cut(c) -> dict[str, float | None]:
    """Each model's share of own samples cut over its last steps (none where RL never got to its live display)."""
    return {m: c.display.cut.train_frac(m) for m in c.names} if hasattr(c, "display") else {}


def trained_by_every_model(result: RunResult) -> str:
    """What the run trained, and (when a stop came mid-step) how much of it the useful rate counts."""
    said = f"{result.trained_prompts} prompts trained by every model"
    if result.useful_prompts == result.trained_prompts:
        return f"{said} in {result.duration_s:.0f}s"
    return (f"{said}, {result.useful_prompts} of them in the {result.duration_s:.0f}s before the stop (the useful "
            "rate's count; the rest in steps finished while stopping)")


def report(c, result: RunResult | None) -> int:
    """Summary, markers, exit code: 1 if the run failed, 128 + signal if a signal stopped it, else 0."""
    if c.preps and (c.finals or result is not None):
        print_summary(c.cfg, c.preps, c.finals, train_cut(c))
    if result is not None:
        a = result.audit
        lost = (f"lost {a.lost}" if not c.failures.aborted else
                f"{a.lost} not trained (kept in the log: a resume trains them)")
        c.say(f"[run] {trained_by_every_model(result)}; "
              f"steps {result.steps}; {result.moves} moves, {result.regroups} learner re-formations; "
              f"experience logged {a.logged}, {lost}, duplicated {a.duplicates}")
    if c.interrupted is not None:
        name = c.stopped_by or signal.Signals(c.interrupted).name
        # In the config's model order, not the order the finals came in: the marker reads the same every run.
        saved = ", ".join(f"{m} at step {c.finals[m].step}" for m in c.names if m in c.finals) \
            or "none (nothing trained)"
        if c.failures.aborted:
            saved = (f"none (a second {signal.Signals(c.failures.aborted).name} skipped them; `launch.py resume "
                     f"{c.run_dir}` goes on from each model's newest checkpoint, or its warm start, and trains the "
                     "logged samples it had not)")
        mark(c.run_dir, "INTERRUPTED", f"stopped by {name} during {c.interrupted_in}; "
                                       f"checkpoints and final evaluations: {saved}")
    if c.failures.messages:
        text = "; ".join(c.failures.messages)
        mark(c.run_dir, "FAILED", text)
        print(f"error: {text}", file=sys.stderr, flush=True)
        return 1
    return 128 + c.interrupted if c.interrupted is not None else 0

