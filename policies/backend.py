"""Generation backends: sample completions and their behaviour log-probs.

`GenerationBackend` is what a generator worker talks to: prompts as token ids in, token
ids + per-token log-probs out, new weights pushed in as tensors (no disk round trip) with
their version, and device memory given back and re-taken when MWRA moves the worker to
another role. `HFBackend` implements it with HF transformers and a dynamic KV cache (the
CPU path); `CudaHFBackend` is the same code in bf16 with a static KV cache (the GPU path);
`policies.sglang_backend.SglangBackend` drives an sglang engine or server. Nothing above
this module needs to know which one runs; tests/test_backend_contract.py holds all three
to the same contract.
"""

from __future__ import annotations

import random
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import msgspec
import torch
from transformers import Cache, DynamicCache, PreTrainedModel, StaticCache

from policies.logprobs import cache_argument, position_ids_from_mask


class Sample(msgspec.Struct, gc=False):
    """One sampled completion. logprobs[i] belongs to completion_ids[i]."""

    completion_ids: list[int]  # ends with EOS (or another end token: stop_ids) when finish_reason == "stop"
    logprobs: list[float]  # log-prob under the distribution sampled from (after temperature, top-k and top-p)
    finish_reason: Literal["stop", "length"]  # stop = produced an end token; length = hit max_new_tokens


class BackendReleased(RuntimeError):
    """The backend gave its memory back (release_memory) and was asked to work before resume_memory."""


@runtime_checkable
class GenerationBackend(Protocol):
    """Samples completions from the current policy weights."""

    version: int  # weight version of the policy now loaded
    released: bool  # True between release_memory() and resume_memory()

    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[list[Sample]]:
        """num_samples completions per prompt: result[i][j] is sample j of prompts[i].

        temperature=0 is greedy (all samples then equal; top_p and top_k are ignored). top_k > 0 keeps
        the k likeliest tokens, top_p < 1 the smallest set of likeliest tokens holding that much
        probability (after top_k); top_p=1, top_k=0 sample the whole distribution. A backend that
        cannot report log-probs of the truncated distribution refuses top_p/top_k (ValueError). A
        given seed makes the result reproducible for the same weights and inputs."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """New weights from tensors, by name (those sent; a name the model lacks is an error), and their version."""
        ...

    def release_memory(self) -> None:
        """Give back the device memory of weights and KV cache; generate and load refuse until resumed."""
        ...

    def resume_memory(self) -> None:
        """Take the memory again; generation continues with the weights held before the release."""
        ...

    def close(self) -> None:
        """The worker is done with this backend (a role switch): stop what it started."""
        ...


def request_rows(prompts: list[list[int]], num_samples: int, temperature: float, top_p: float = 1.0,
                 top_k: int = 0) -> list[list[int]]:
    """Every backend's checks of a request, and its rows: each prompt ``num_samples`` times, in order."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (a BOS, if nothing else)")
    return [p for p in prompts for _ in range(num_samples)]


class Sampling(NamedTuple):
    """How a backend draws each next token (GenerationBackend.generate says what each means)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0


class HFBackend:
    """Batched sampling with an HF causal LM, a KV cache and left padding.

    All prompts x samples run as one batch (split into chunks of `max_batch` rows); each distinct
    prompt's forward runs once, and its cache is copied to the rows of its samples.
    A sequence stops at its own EOS, which is kept in the completion with its
    log-prob; rows that have finished are dropped from the batch and its cache.
    """

    drops_finished_rows = True  # a dynamic cache can shrink (and grow: a prompt's forward is shared by its samples);
    # a static one keeps its shapes

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int,
        pad_token_id: int,
        device: str | torch.device = "cpu",
        max_batch: int = 256,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.cache_argument = cache_argument(self.model)  # asked once: not on every decoding step
        self.eos_token_id = eos_token_id
        # tokens that end a row as EOS does (a base model's line break: policies.templates.end_ids)
        self.end_set = frozenset({eos_token_id, *stop_ids})
        self.end_ids = torch.tensor(sorted(self.end_set), device=self.device)
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.version = 0
        self.released = False

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy the tensors of `state` into the model's of the same names, in place (cast to its dtype)."""
        self._check_held("load_state_dict")
        unknown = sorted(set(state) - set(self.model.state_dict()))
        if unknown:  # checked first: nothing is copied from a state that does not fit
            raise RuntimeError(f"Unexpected key(s) in the weights: {unknown[:3]}")
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self.version = version

    def release_memory(self) -> None:
        """Weights go to host memory and the allocator's cache is emptied (on CPU they stay put)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        self.model.to(self.device)
        self.released = False

    def close(self) -> None:
        pass  # the model is the worker's: it goes when the worker drops it

    def _check_held(self, what: str) -> None:
        if self.released:
            raise BackendReleased(f"{what}: the backend's memory is released; call resume_memory() first")

    def _new_cache(self, batch: int, max_len: int) -> Cache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[list[Sample]]:
        self._check_held("generate")
        rows = request_rows(prompts, num_samples, temperature, top_p, top_k)
        sampling = Sampling(temperature, top_p, top_k)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch):
            chunk = rows[start : start + self.max_batch]
            samples.extend(self._generate_batch(chunk, max_new_tokens, sampling, generator))
        return [samples[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling,
        generator: torch.Generator,
    ) -> list[Sample]:
        B = len(prompts)
        distinct, copies = self._distinct(prompts)
        input_ids, mask = self._left_pad(distinct)  # (U, P): a group's samples share their prompt's forward
        positions = position_ids_from_mask(mask)
        cache = self._new_cache(B, input_ids.shape[1] + max_new_tokens)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        live = torch.arange(B, device=self.device)  # original row of each batch row
        over = torch.zeros(B, dtype=torch.bool, device=self.device)  # rows past their EOS (kept by a static cache)
        for step in range(max_new_tokens):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                **{self.cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
            if step == 0 and copies is not None:  # the prompts ran once each: now a row per sample
                logits, mask, positions = logits[copies], mask[copies], positions[copies]
                cache.batch_select_indices(copies)
            next_ids, next_lp = self._pick_open(logits, over, sampling, generator)  # (b,)
            for row, tok, lp, done in zip(live.tolist(), next_ids.tolist(), next_lp.tolist(), over.tolist()):
                if not done:
                    tokens[row].append(tok)
                    logprobs[row].append(lp)
            over = over | torch.isin(next_ids, self.end_ids)
            if bool(over.all()):
                break
            if self.drops_finished_rows and bool(over.any()):
                keep = (~over).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, mask, positions, next_ids, over = live[keep], mask[keep], positions[keep], next_ids[keep], over[keep]
            input_ids = next_ids[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return [
            Sample(
                completion_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason="stop" if tokens[i] and tokens[i][-1] in self.end_set else "length",
            )
            for i in range(B)
        ]

    def _pick_open(self, logits: torch.Tensor, over: torch.Tensor, sampling: Sampling,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick for the rows not yet past EOS only (rows past it get PAD), so both cache
        kinds draw the same random numbers for the same rows and sample alike."""
        if not bool(over.any()):
            return self._pick(logits, sampling, generator)
        open_rows = (~over).nonzero().squeeze(-1)
        ids, lp = self._pick(logits[open_rows], sampling, generator)
        all_ids = torch.full_like(over, self.pad_token_id, dtype=torch.long)
        all_lp = torch.zeros(over.shape, dtype=lp.dtype, device=lp.device)
        return all_ids.index_copy_(0, open_rows, ids), all_lp.index_copy_(0, open_rows, lp)

    def _distinct(self, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor | None]:
        """The distinct prompts, and for each row the index of its own among them (None: each row runs its own,
        where the prompts are all distinct or the cache cannot change its batch size)."""
        index: dict[tuple[int, ...], int] = {}
        of = [index.setdefault(tuple(p), len(index)) for p in prompts]
        if not self.drops_finished_rows or len(index) == len(prompts):
            return prompts, None
        return [list(p) for p in index], torch.tensor(of, device=self.device)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @staticmethod
    def _pick(
        logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its log-prob, (b,) each. Greedy reports the untempered log-prob.

        The log-prob is the sampled token's under the distribution it was drawn from: after
        temperature, top-k and top-p, renormalised. The learner takes it as the behaviour
        log-prob of its importance weights, so it must be the sampler's own."""
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            ids = logp.argmax(dim=-1)
        else:
            logp = _truncated(torch.log_softmax(logits / sampling.temperature, dim=-1), sampling.top_p, sampling.top_k)
            ids = _sample(logp, generator)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


class CudaHFBackend(HFBackend):
    """HFBackend on a GPU: bf16 weights and a static KV cache sized prompt + max_new_tokens.

    The same sampling loop; the cache keeps every row to the end of the batch (finished
    rows go on computing, their tokens ignored) so shapes stay fixed, which is what lets
    the static cache be compiled or graph-captured. Released memory goes to host RAM."""

    drops_finished_rows = False

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 max_batch: int = 256, stop_ids: tuple[int, ...] = ()) -> None:
        super().__init__(model.to(dtype), eos_token_id, pad_token_id, device, max_batch, stop_ids)

    def _new_cache(self, batch: int, max_len: int) -> Cache:
        return StaticCache(config=self.model.config, max_cache_len=max_len)


def _sample(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from softmax-normalised `logp` (b, V), by inverting the CDF.

    torch.multinomial spends ~140 ms per step on 128 x 50k rows on one CPU thread
    (it draws an exponential per entry); cumsum + searchsorted takes ~25 ms. A token
    with zero probability adds nothing to the CDF, so it can never be drawn: not even
    where u rounds up to the total, which would pass every token (the draw is then held
    to the last token with mass, not the vocabulary's last, which top-k/top-p may cut)."""
    cdf = logp.exp().cumsum(dim=-1)  # (b, V)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())  # (b, 1): where the CDF reaches its total
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last).squeeze(-1)


def _truncated(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``logp`` (b, V) kept to its top_k likeliest tokens, then to the top_p nucleus of those, renormalised;
    the rest get -inf. Off (top_p=1, top_k=0) it is ``logp`` itself, so the default samples as before."""
    if 0 < top_k < logp.shape[-1]:  # ties with the k-th token stay: which of equals to drop would be arbitrary
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, -torch.inf), dim=-1)
    if top_p < 1:  # a token stays while the tokens ranked above it hold less than top_p: the likeliest always does
        ranked, order = logp.sort(dim=-1, descending=True)
        probs = ranked.exp()
        out = (probs.cumsum(dim=-1) - probs) >= top_p  # (b, V), in rank order
        out = out.scatter(-1, order, out)  # back to vocabulary order
        logp = torch.log_softmax(logp.masked_fill(out, -torch.inf), dim=-1)
    return logp
