"""Callbacks, as TRL's are: hooks on each learner step, each evaluation and the end, given typed records, that may
stop the run.

    class StopAtReward(TrainerCallback):
        def on_step_end(self, record, control):
            if record.reward_mean >= 0.9:
                control.should_training_stop = True   # stopped as Ctrl-C stops it: checkpoints, INTERRUPTED

A stop is Ctrl-C's: each model checkpoints and runs its final evaluation, the run ends ``interrupted``, and
``resume(run_dir)`` goes on from there. The hooks run on the run's own loop, as each step is reported: a slow hook
slows the run. A plain function is a callback too: it is called with every record (``StepRecord``,
``EvalRecord``, and last the ``TrainResult``) and cannot stop the run. A hook that raises is named in one line;
``Trainer(callback_errors="stop")`` (the default) then stops the run as above, ``"ignore"`` goes on.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import msgspec

CALLBACK_ERRORS = ("stop", "ignore")


class StepRecord(msgspec.Struct, frozen=True):
    """One learner step of one model: its mean reward, the samples it has trained on so far (``samples``: its
    own; ``peer_received``, ``peer_used``: its peers'), the step's busy seconds, the mean staleness of its samples,
    the share of them cut at ``train.max_new_tokens``, and the live held-out accuracy when it was evaluated at
    this step (``accuracy`` on ``eval_n`` problems, else None)."""

    model: str
    step: int
    reward_mean: float
    samples: int
    peer_received: int
    peer_used: int
    step_s: float
    staleness_mean: float
    truncated_frac: float
    accuracy: float | None
    eval_n: int


class EvalRecord(msgspec.Struct, frozen=True):
    """A held-out evaluation of one model: live at a step (``final`` False) or its final one; ``stderr`` and
    ``truncated`` (the share of its completions cut) where measured."""

    model: str
    step: int
    accuracy: float | None
    eval_n: int
    final: bool
    stderr: float | None = None
    truncated: float | None = None


class TrainerControl:
    """What a hook may ask of the run: ``should_training_stop = True`` stops it after this step (TRL's name)."""

    def __init__(self) -> None:
        self.should_training_stop = False


class TrainerCallback:
    """Override the hooks you need; each gets the record and the ``TrainerControl`` (the end: the result)."""

    def on_step_end(self, record: StepRecord, control: TrainerControl) -> None:
        pass

    def on_evaluate(self, record: EvalRecord, control: TrainerControl) -> None:
        pass

    def on_train_end(self, result: Any) -> None:  # a TrainResult
        pass


Callback = TrainerCallback | Callable[[Any], Any]


def name_of(callback: Callback) -> str:
    return getattr(callback, "__qualname__", None) or type(callback).__qualname__


class Callbacks:
    """The user's callbacks as the engine hears a run (``engine.session.RunWatch``): each learner step and each
    model's final become typed records, given to each callback in turn; a stop asked (or a hook that raised, under
    ``errors="stop"``) is the reason the engine stops the run with, as Ctrl-C stops it."""

    def __init__(self, callbacks: list[Callback], errors: str = "stop") -> None:
        self.callbacks, self.errors = list(callbacks), errors

    def step(self, model: str, step: int, report) -> str | None:
        """A learner step (``report``: the engine's StepReport); the reason to stop, or None."""
        record = StepRecord(model=model, step=step, reward_mean=report.reward_mean, samples=report.own_total,
                            peer_received=report.peer_total, peer_used=report.peer_used, step_s=report.step_s,
                            staleness_mean=report.staleness_mean, truncated_frac=report.truncated_frac,
                            accuracy=report.accuracy, eval_n=report.eval_n)
        why = self._each("on_step_end", record, True)
        if report.accuracy is not None:
            why = self._each("on_evaluate", EvalRecord(model=model, step=step, accuracy=report.accuracy,
                                                       eval_n=report.eval_n, final=False,
                                                       truncated=report.eval_truncated), True) or why
        return why

    def final(self, final) -> None:
        """A model's end (``final``: the engine's LearnerFinal): its final evaluation, if it had one. A stop asked
        here has nothing left to stop."""
        if final.accuracy is not None:
            self._each("on_evaluate", EvalRecord(model=final.model, step=final.step, accuracy=final.accuracy,
                                                 eval_n=final.eval_n, final=True, stderr=final.accuracy_stderr,
                                                 truncated=final.truncated), False)

    def end(self, result) -> None:
        for callback in self.callbacks:
            self._call(callback, "on_train_end", result, None, False)

    def _each(self, hook: str, record, can_stop: bool) -> str | None:
        why = None
        for callback in self.callbacks:
            control = TrainerControl()
            said = self._call(callback, hook, record, control, can_stop)
            if said is None and control.should_training_stop:
                said = f"callback {name_of(callback)} ({hook} at {record.model} step {record.step})"
            why = why or said
        return why

    def _call(self, callback: Callback, hook: str, record, control: TrainerControl | None,
              can_stop: bool) -> str | None:
        """One hook of one callback; an exception is one line, and the reason to stop under ``errors="stop"``
        where the run is still going (``can_stop``)."""
        try:
            if isinstance(callback, TrainerCallback):
                method = getattr(callback, hook)
                method(record) if control is None else method(record, control)
            else:
                callback(record)
        except Exception as exc:
            where = f"{hook} at {record.model} step {record.step}" if hasattr(record, "step") else hook
            stops = self.errors == "stop" and can_stop
            action = "stopping the run" if stops else "the run goes on"
            print(f"mutual_rl: callback {name_of(callback)} raised {type(exc).__name__}: {exc} ({where}; {action}: "
                  f"callback_errors={self.errors!r})", file=sys.stderr, flush=True)
            if stops:
                return f"callback {name_of(callback)} raised {type(exc).__name__} ({where})"
        return None
