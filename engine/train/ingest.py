"""A learner's inbox: own groups by prompt, peer samples bridged by the THL on arrival."""

from __future__ import annotations

import collections

import numpy as np

from engine.train.batching import OwnSample, PeerSample
from engine.train.trust import untrusted
from exchange.protocol import Experience
from policies.templates import completion_ids, end_ids, finish_id, prompt_format, prompt_ids
from tokenbridge import Bridge, BridgeError


class Ingest:
    """Own experience grouped per prompt; peer experience retokenized into our vocabulary.

    Exactly-once: a (model, prompt, sample) seen before is ignored, whichever generator
    sent it (pool mode regenerates a unit whose generator died after publishing part of
    it). A peer sample for a prompt this learner already trained on is counted as late
    and dropped; one the THL cannot bridge is counted as a failure and dropped.
    """

    def __init__(self, spec, tokenizer, peer_tokenizers: dict, task, group_size: int, run_id: str | None = None,
                 peer_ends: dict[str, str] | None = None):
        self.spec, self.tokenizer, self.task, self.G, self.run_id = spec, tokenizer, task, group_size, run_id
        self.format = prompt_format(spec)
        # a peer's finished completion ends as ours do: with our EOS, or our line break where we end on one
        finish = finish_id(tokenizer, self.format.end)
        self.bridges = {name: Bridge(tok, tokenizer, dst_eos_id=finish) for name, tok in peer_tokenizers.items()}
        # a peer that ends on a line break: that break stands for its EOS when its text crosses (the bridge maps
        # an end token, not the text of one), so the receiver sees a finished answer, not one going on
        self.line_ends = {name: (frozenset(end_ids(tok, "newline")) - {tok.eos_token_id}, tok.eos_token_id)
                          for name, tok in peer_tokenizers.items() if (peer_ends or {}).get(name) == "newline"}
        self.vocab = {name: len(tok) for name, tok in peer_tokenizers.items()} | {spec.name: len(tokenizer)}
        self.rejected: collections.Counter[str] = collections.Counter()  # "<model>: <why>" -> count
        self.own: dict[int, list[OwnSample]] = {}
        self.cut: collections.Counter[int] = collections.Counter()  # prompt -> own samples that hit max_new_tokens
        self.complete: collections.deque[int] = collections.deque()
        self.consumed: set[int] = set()
        self.peers: dict[int, list[PeerSample]] = {}
        self.peer_counts: collections.Counter[tuple[str, int]] = collections.Counter()
        self.seen: set[tuple[str, int, int]] = set()
        self.refused: set[tuple[str, str]] = set()  # (experience id, why) of what ``rejected`` counts
        self._prompts: dict[int, np.ndarray] = {}
        self.failures = 0
        self.late = 0

    def add(self, exp: Experience) -> None:
        self.add_many([exp])

    def add_many(self, exps: list[Experience]) -> None:
        """Take what arrived; the peer completions waiting from each peer cross the THL in one batch."""
        waiting: dict[str, list[Experience]] = {}
        for exp in exps:
            if exp.model not in self.vocab:
                continue
            why = untrusted(exp, self.run_id, self.G, self.vocab)  # before the repeat check: a forged copy counts
            if why is not None:
                if (exp.experience_id, why) not in self.refused:  # (a log replay brings it again: counted once)
                    self.refused.add((exp.experience_id, why))
                    self.rejected[f"{exp.model}: {why}"] += 1  # never reaches a model; in the step's metrics
                continue
            key = (exp.model, exp.prompt_id, exp.sample_index)
            if key in self.seen:
                continue
            self.seen.add(key)
            if exp.model == self.spec.name:
                self._add_own(exp)
            elif exp.model in self.bridges:
                if exp.prompt_id in self.consumed:
                    self.late += 1
                    continue
                self.peer_counts[(exp.model, exp.prompt_id)] += 1
                waiting.setdefault(exp.model, []).append(exp)
        for model, peers in waiting.items():
            completions = [self._ended(model, e) for e in peers]
            bridged = self.bridges[model].batch(completions, [e.logprob_array for e in peers])
            for exp, out in zip(peers, bridged):
                self._add_peer(exp, out)

    def _ended(self, model: str, exp: Experience) -> np.ndarray:
        """A line-ending peer's completion with its final line break read as its EOS (the same log-prob: the
        probability it gave to ending there)."""
        ids = exp.completion_array
        if model in self.line_ends and exp.finish_reason == "stop" and len(ids) and int(ids[-1]) in self.line_ends[model][0]:
            ids = ids.copy()
            ids[-1] = self.line_ends[model][1]
        return ids

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def _add_own(self, exp: Experience) -> None:
        group = self.own.setdefault(exp.prompt_id, [])
        group.append(OwnSample(
            prompt_ids=exp.prompt_array, completion_ids=exp.completion_array,
            behaviour_logprobs=exp.logprob_array, reward=exp.reward, verified=exp.verified,
            weight_version=exp.weight_version, prompt_id=exp.prompt_id, reward_parts=exp.reward_parts,
            finished=exp.finish_reason == "stop",
        ))
        self.cut[exp.prompt_id] += exp.finish_reason == "length"
        if len(group) == exp.group_size:
            self.complete.append(exp.prompt_id)

    def _add_peer(self, exp: Experience, bridged) -> None:
        if isinstance(bridged, BridgeError):
            self.failures += 1  # counted, reported in metrics; the sample is not used
            return
        self.peers.setdefault(exp.prompt_id, []).append(PeerSample(
            model=exp.model, prompt_id=exp.prompt_id, prompt_ids=self._prompt(exp.prompt_id),
            completion_ids=np.asarray(bridged.dst_ids, dtype=np.int64),
            behaviour_logprobs=np.asarray(bridged.dst_logprobs, dtype=np.float32),
            align=np.asarray(bridged.dst_group, dtype=np.int64), residual=float(bridged.residual),
            reward=exp.reward, verified=exp.verified, weight_version=exp.weight_version,
            source_tokens=len(exp.logprob_array),
        ))

    def _prompt(self, prompt_id: int) -> np.ndarray:
        """Our own template for the prompt: only the completion crosses the bridge."""
        if prompt_id not in self._prompts:
            prompt = self.task.problem(prompt_id).prompt
            self._prompts[prompt_id] = np.asarray(prompt_ids(self.tokenizer, self.format, prompt))
        return self._prompts[prompt_id]

    def reference_samples(self, prompts: list[int]) -> list[PeerSample]:
        """The task's reference solution of each prompt, in the peer slots (the answer-key control)."""
        out = []
        for pid in prompts:
            ids = np.asarray(completion_ids(self.tokenizer, self.task.worked_solution(self.task.problem(pid)),
                                            self.format.end))
            out.append(PeerSample(model="reference", prompt_id=pid, prompt_ids=self._prompt(pid), completion_ids=ids,
                                  behaviour_logprobs=np.zeros(len(ids), dtype=np.float32), align=np.arange(len(ids)),
                                  residual=0.0, reward=1.0, verified=True, weight_version=0))
        return out

    def complete_own_groups(self) -> int:
        return len(self.complete)

    def queued_own(self) -> int:
        return sum(len(g) for g in self.own.values())

    def next_own_groups(self, n: int) -> list[int]:
        """The prompt ids of the n oldest complete own groups (not yet removed)."""
        return list(self.complete)[:n]

    def cut_in(self, prompts: list[int]) -> int:
        """How many own samples of these prompts hit max_new_tokens (before ``take`` removes them)."""
        return sum(self.cut[p] for p in prompts)

    def take(self, prompts: list[int], peer_models: list[str]) -> tuple[list[OwnSample], list[PeerSample], int]:
        """Remove a step's own and peer samples; from now on late peer samples for them are dropped.

        Returns (own samples, peer samples, number of (peer model, prompt) groups still incomplete).
        """
        misses = sum(self.peer_counts[(m, p)] < self.G for m in peer_models for p in prompts)
        for _ in prompts:
            self.complete.popleft()
        self.consumed.update(prompts)
        own = [s for p in prompts for s in self.own.pop(p)]
        peers = [s for p in prompts for s in self.peers.pop(p, [])]
        for p in prompts:
            self.cut.pop(p, None)
            for m in self.bridges:
                self.peer_counts.pop((m, p), None)
        return own, peers, misses

    def peers_complete(self, prompts: list[int], models: list[str]) -> bool:
        return all(self.peer_counts[(m, p)] >= self.G for m in models for p in prompts)
