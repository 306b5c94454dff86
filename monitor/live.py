"""The monitor's state: a pure aggregation of decoded exchange messages and metrics.jsonl records.

``LiveState.take(msg)`` takes an ``Experience``, ``Stats``, ``Assign`` or ``WeightsReady``;
``LiveState.record(rec)`` takes one metrics.jsonl record. Neither reads a clock: times come
from the messages and records themselves, so a replay at any speed aggregates exactly as the
live run did. ``snapshot()`` is what the page draws (plain JSON types), ``text()`` the
``--once`` view. Every series is bounded (thinned by half when full), so a long run costs a
constant amount of memory; prompt stories are kept for the newest ``keep_prompts`` prompts.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from exchange.protocol import Assign, Experience, Stats, WeightsReady

MAX_POINTS = 1500  # per series: a chart has no more pixels than this
RATE_WINDOW_S = 10  # samples/s and tokens/s: over the last this many seconds of experience time
STALENESS_BINS = 9  # 0 .. 7 and "8 or more"
RESIDUAL_NOTE = ("A residual of 1.0 is normal on digits: GPT-2 writes ' 42' as one token, Mistral as three, "
                 "so no character of the answer maps one token to one token; the sample still trains.")


class Series:
    """Points (x, y...) thinned by half whenever ``MAX_POINTS`` is reached."""

    def __init__(self) -> None:
        self.points: list[list] = []

    def add(self, *point) -> None:
        self.points.append(list(point))
        if len(self.points) >= MAX_POINTS:
            self.points = self.points[::2]


class ModelView:
    """One model: what its generators produced (from the exchange) and its learner trained (from metrics)."""

    def __init__(self) -> None:
        self.samples = self.tokens = 0
        self._second, self._open = 0, [0, 0]  # the second being counted: [samples, tokens]
        self._window: deque = deque()  # finished seconds: (second, samples, tokens)
        self._first: int | None = None
        self.length = Series()  # (time, mean completion tokens of that second)
        self.reward = Series()  # (own samples trained, time, reward_mean)
        self.accuracy = Series()  # (own samples trained, time, accuracy, problems)
        self.staleness = [0] * STALENESS_BINS
        self.learner_version = 0
        self.warm = self.final = None
        self.staleness_mean = None
        self.last_step: dict = {}

    def count(self, t: float, tokens: int) -> None:
        second = int(t)
        if self._first is None:
            self._first = second
        if second != self._second:
            self._close_second(second)
        self._open[0] += 1
        self._open[1] += tokens

    def _close_second(self, second: int) -> None:
        """A new second began: the open one gives a length point and joins the rate window."""
        n, tok = self._open
        if n:
            self.length.add(self._second, round(tok / n, 2))
            self._window.append((self._second, n, tok))
        self._second, self._open = second, [0, 0]
        while self._window and self._window[0][0] < second - RATE_WINDOW_S:
            self._window.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(samples/s, tokens/s) over the last RATE_WINDOW_S whole seconds before ``now``."""
        if self._first is None:
            return 0.0, 0.0
        lo = int(now) - RATE_WINDOW_S
        seconds = [(s, n, tok) for s, n, tok in self._window if s >= lo]
        span = min(RATE_WINDOW_S, max(int(now) - self._first, 1))  # a run younger than the window
        return sum(x[1] for x in seconds) / span, sum(x[2] for x in seconds) / span


class LiveState:
    def __init__(self, models: list[str] | None = None, keep_prompts: int = 200, run: str = "") -> None:
        self.run = run
        self.models: dict[str, ModelView] = {}
        for m in models or []:
            self._model(m)
        self.now = 0.0  # the latest time seen in any message or record
        self.t0: float | None = None
        self.keep_prompts = keep_prompts
        self.prompts: OrderedDict[int, list[tuple[Experience, int]]] = OrderedDict()  # (sample, staleness), newest last
        self.received = self.missed = self.skipped_lines = 0
        self.broker: dict = {}
        self.edges: dict[tuple[str, str], dict] = {}
        self.workers: dict[str, list] = {}  # worker -> [[time, role, model, reason], ...]
        self.moves: deque = deque(maxlen=200)  # controller moves: time, reason, changes
        self.decisions = 0  # MWRA decisions that did not move anything
        self.events: deque = deque(maxlen=100)  # notable run events, one line each
        self.newest_sample_at = 0.0
        self.replay_done = False  # the replay reached its end, or the live run's broker closed
        self.mode = "live"
        self.sample_cap = 0.0  # experiences/s the broker forwards to this monitor at most (0: no cap)

    def _model(self, name: str) -> ModelView:
        view = self.models.get(name)
        if view is None:
            view = self.models[name] = ModelView()
        return view

    def _clock(self, t: float) -> None:
        if t > self.now:
            self.now = t
        if self.t0 is None:
            self.t0 = t

    # --- the exchange ---
    def take(self, msg) -> None:
        kind = type(msg)
        if kind is Experience:
            self._experience(msg)
        elif kind is Stats:
            self._stats(msg)
        elif kind is Assign:
            self._role(msg.worker_id, msg.role, msg.model, msg.reason, self.now)
        elif kind is WeightsReady:
            self._clock(msg.time)
            view = self._model(msg.model)
            view.learner_version = max(view.learner_version, msg.version)

    def _experience(self, exp: Experience) -> None:
        self.received += 1
        if exp.generated_at > self.newest_sample_at:
            self.newest_sample_at = exp.generated_at  # how far behind the exchange the view is
        self._clock(exp.generated_at)
        view = self._model(exp.model)
        view.samples += 1
        tokens = len(exp.completion_ids) >> 2  # int32 ids
        view.tokens += tokens
        view.count(exp.generated_at, tokens)
        staleness = max(view.learner_version - exp.weight_version, 0)
        view.staleness[min(staleness, STALENESS_BINS - 1)] += 1
        group = self.prompts.get(exp.prompt_id)
        if group is None:
            group = self.prompts[exp.prompt_id] = []
            if len(self.prompts) > self.keep_prompts:
                self.prompts.popitem(last=False)
        group.append((exp, staleness))

    def _stats(self, st: Stats) -> None:
        self._clock(st.time)
        if st.role == "broker":
            self.broker = {"accepted": st.accepted_total, "dropped": st.dropped_total,
                           "rejected": st.rejected_total, "backlog": dict(st.subscriber_backlog),
                           "subscriber_dropped": dict(st.subscriber_dropped), "topic_rates": dict(st.topic_rates)}
        elif st.worker_id not in self.workers or self.workers[st.worker_id][-1][1:3] != [st.role, st.model]:
            self._role(st.worker_id, st.role, st.model, "reported by the worker", st.time)

    def missed_by(self, name: str) -> None:
        """The broker's count of what it dropped for subscriber ``name`` (a lossy monitor falls behind)."""
        self.missed = self.broker.get("subscriber_dropped", {}).get(name, self.missed)

    def _role(self, worker: str, role: str, model: str, reason: str, t: float) -> None:
        spans = self.workers.setdefault(worker, [])
        if spans and spans[-1][1:3] == [role, model]:
            return
        spans.append([t, role, model, reason])
        del spans[:-50]

    # --- metrics.jsonl ---
    def record(self, rec: dict) -> None:
        t = rec.get("time")
        if not isinstance(t, (int, float)):
            self.skipped_lines += 1
            return
        self._clock(t)
        event, model = rec.get("event"), rec.get("model")
        if event == "step" and model:
            self._step(model, rec, t)
        elif event == "start" and model:
            self._model(model).warm = rec.get("warm_accuracy")
        elif event == "final" and model:
            self._model(model).final = rec.get("accuracy")
        elif event == "allocation":
            for w, (role, m) in (rec.get("workers") or {}).items():
                self._role(w, role, m, "initial" if w not in self.workers else "allocation", t)
        elif event == "assign":
            self.moves.append({"time": t, "reason": rec.get("reason", ""), "changes": rec.get("changes", {})})
            for w, (role, m) in (rec.get("changes") or {}).items():
                self._role(w, role, m, rec.get("reason", ""), t)
        elif event == "role_switch":
            self._role(rec["worker"], rec["to_role"], rec["to_model"], "switched", t)
        elif rec.get("kind") == "mwra_decision" and not rec.get("acted"):
            self.decisions += 1
        elif event in ("worker_lost", "model_left", "peer_gone", "peer_back", "resumed", "learner_restart"):
            self.events.append({"time": t, "text": f"{event}: " + ", ".join(
                f"{k}={v}" for k, v in rec.items() if k not in ("time", "event"))})

    def _step(self, model: str, rec: dict, t: float) -> None:
        view = self._model(model)
        view.last_step = rec
        view.learner_version = max(view.learner_version, rec.get("weight_version") or 0)
        own = rec.get("own_experiences", 0)
        if rec.get("reward_mean") is not None:
            view.reward.add(own, t, round(rec["reward_mean"], 4))
        if rec.get("accuracy") is not None:
            view.accuracy.add(own, t, rec["accuracy"], "live")
        view.staleness_mean = rec.get("staleness_mean")
        peers = [p for p in self.models if p != model] or list((rec.get("thl_residual_by_peer") or {}))
        by_peer = rec.get("thl_residual_by_peer") or {}
        if not by_peer and len(peers) == 1 and rec.get("thl_residual_mean") is not None:
            by_peer = {peers[0]: rec["thl_residual_mean"]}  # an older run: one peer, so the mean is its own
        for peer in set(peers) | set(by_peer):
            edge = self._edge(peer, model)
            if peer in by_peer:
                edge["residual_sum"] += by_peer[peer]
                edge["residual_n"] += 1
            share = 1.0 / max(len(peers), 1)  # a step's counters are not per peer: shared out evenly
            edge["rescue"] += (rec.get("obj/rescue_set_size") or 0) * share
        edge_all = self._edge("*", model)
        for key, field in (("late", "peer_late"), ("dropped", "staleness_dropped"), ("used", "peer_used"),
                           ("received", "peer_experiences"), ("failures", "thl_failures")):
            edge_all[key] = rec.get(field) or 0  # cumulative in the learner's record

    def _edge(self, src: str, dst: str) -> dict:
        edge = self.edges.get((src, dst))
        if edge is None:
            edge = self.edges[(src, dst)] = {"residual_sum": 0.0, "residual_n": 0, "rescue": 0.0}
        return edge

    # --- views ---
    def snapshot(self) -> dict:
        models = {}
        for name, v in self.models.items():
            sps, tps = self._rates(name, v)
            models[name] = {"samples": v.samples, "tokens": v.tokens, "samples_per_s": round(sps, 2),
                            "tokens_per_s": round(tps, 1), "reward": v.reward.points, "accuracy": v.accuracy.points,
                            "length": v.length.points, "staleness": v.staleness, "staleness_mean": v.staleness_mean,
                            "warm_accuracy": v.warm, "final_accuracy": v.final, "version": v.learner_version,
                            "step": v.last_step.get("step", 0)}
        return {"run": self.run, "mode": self.mode, "ended": self.replay_done, "now": self.now, "t0": self.t0, "models": models, "edges": self._edges(),
                "workers": self.workers, "moves": list(self.moves), "decisions_without_move": self.decisions,
                "events": list(self.events), "received": self.received, "missed": self.missed,
                "shown": round(self.shown(), 4), "sample_cap": self.sample_cap, "broker": self.broker, "prompts": list(self.prompts)[-40:],
                "residual_note": RESIDUAL_NOTE}

    def _rates(self, name: str, view: ModelView) -> tuple[float, float]:
        """(samples/s, tokens/s): counted from what arrived, or, while this monitor misses some, the broker's
        own rate of the model's topic (tokens/s scaled from the mean length of what arrived)."""
        sps, tps = view.rates(self.now)
        exact = (self.broker.get("topic_rates") or {}).get(f"exp.{name}")
        if not self.missed or exact is None:
            return sps, tps
        return exact, (tps / sps * exact if sps else 0.0)

    def shown(self) -> float:
        """Share of the exchange's messages this monitor aggregated (the rest the broker dropped for it)."""
        return self.received / max(self.received + self.missed, 1)

    def _edges(self) -> list[dict]:
        names = list(self.models)
        out = []
        for src in names:
            sps = self._rates(src, self.models[src])[0]
            for dst in names:
                if src == dst:
                    continue
                e = self.edges.get((src, dst), {"residual_sum": 0.0, "residual_n": 0, "rescue": 0.0})
                totals = self.edges.get(("*", dst), {})
                out.append({"src": src, "dst": dst, "rate": round(sps, 2), "rescue": round(e["rescue"], 1),
                            "residual": round(e["residual_sum"] / e["residual_n"], 3) if e["residual_n"] else None,
                            "late": totals.get("late", 0), "dropped": totals.get("dropped", 0),
                            "used": totals.get("used", 0), "received": totals.get("received", 0)})
        return out

    def text(self) -> str:
        """The plain-text snapshot of ``--once``."""
        snap = self.snapshot()
        lines = [f"run {self.run}: {self.received} experiences seen, {self.missed} missed "
                 f"(showing {100 * self.shown():.1f}%)"]
        for name, m in snap["models"].items():
            reward = m["reward"][-1][2] if m["reward"] else None
            acc, which = next(((a, w) for a, w in ((m["final_accuracy"], "final"),
                                                  (m["accuracy"][-1][2] if m["accuracy"] else None, "live"),
                                                  (m["warm_accuracy"], "warm start")) if a is not None), (None, ""))
            lines.append(f"  {name}: step {m['step']}  reward {_f(reward)}  acc {_f(acc)} ({which})  "
                         f"{m['samples_per_s']:.1f} samples/s  {m['tokens_per_s']:.0f} tokens/s  "
                         f"staleness {_f(m['staleness_mean'], '.2f')}  generated {m['samples']} samples")
        for e in snap["edges"]:
            lines.append(f"  {e['src']} -> {e['dst']}: {e['rate']:.1f} exp/s  rescued {e['rescue']:.0f}  "
                         f"THL residual {_f(e['residual'])}  used {e['used']}  late {e['late']}  "
                         f"dropped {e['dropped']}")
        for w, spans in sorted(snap["workers"].items()):
            lines.append(f"  {w}: " + " -> ".join(f"{r}:{m}" for _, r, m, _ in spans[-4:]))
        return "\n".join(lines)


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


