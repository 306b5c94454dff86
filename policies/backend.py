"""Generation backends: sample completions and their behaviour log-probs.

`GenerationBackend` is what a generator worker talks to; `HFBackend` implements it with
HF transformers and a KV cache on CPU or GPU. An sglang backend would implement the
same Protocol (prompts as token ids in, token ids + log-probs out, weights pushed in
by version), so nothing above this module needs to know which one runs.
"""

from __future__ import annotations

import random
from typing import Literal, Protocol

import msgspec
import torch
from transformers import DynamicCache, PreTrainedModel

from policies.logprobs import position_ids_from_mask


class Sample(msgspec.Struct, gc=False):
    """One sampled completion. logprobs[i] belongs to completion_ids[i]."""

    completion_ids: list[int]  # ends with EOS when finish_reason == "stop"
    logprobs: list[float]  # log-prob under the distribution sampled from (after temperature)
    finish_reason: Literal["stop", "length"]  # stop = produced EOS; length = hit max_new_tokens


class GenerationBackend(Protocol):
    """Samples completions from the current policy weights."""

    version: int  # weight version of the policy now loaded

    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
    ) -> list[list[Sample]]:
        """num_samples completions per prompt: result[i][j] is sample j of prompts[i].

        temperature=0 is greedy (all samples then equal). A given seed makes the
        result reproducible for the same weights and inputs."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap in new weights (all of them) and record their version."""
        ...


class HFBackend:
    """Batched sampling with an HF causal LM, a KV cache and left padding.

    All prompts x samples run as one batch (split into chunks of `max_batch` rows).
    A sequence stops at its own EOS, which is kept in the completion with its
    log-prob; rows that have finished are dropped from the batch and its cache.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int,
        pad_token_id: int,
        device: str | torch.device = "cpu",
        max_batch: int = 256,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.version = 0

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state` into the model in place (strict: every key must match)."""
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)
        self.version = version

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
    ) -> list[list[Sample]]:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (a BOS, if nothing else)")
        rows = [p for p in prompts for _ in range(num_samples)]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch):
            chunk = rows[start : start + self.max_batch]
            samples.extend(self._generate_batch(chunk, max_new_tokens, temperature, generator))
        return [samples[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> list[Sample]:
        B = len(prompts)
        input_ids, mask = self._left_pad(prompts)  # (B, P)
        positions = position_ids_from_mask(mask)
        cache = DynamicCache(config=self.model.config)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        live = torch.arange(B, device=self.device)  # original row of each batch row
        for _ in range(max_new_tokens):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            next_ids, next_lp = self._pick(out.logits[:, -1].float(), temperature, generator)  # (b,)
            finished = next_ids == self.eos_token_id
            for row, tok, lp in zip(live.tolist(), next_ids.tolist(), next_lp.tolist()):
                tokens[row].append(tok)
                logprobs[row].append(lp)
            keep = (~finished).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < finished.numel():
                cache.batch_select_indices(keep)
                live, mask, positions, next_ids = live[keep], mask[keep], positions[keep], next_ids[keep]
            input_ids = next_ids[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return [
            Sample(
                completion_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason="stop" if tokens[i] and tokens[i][-1] == self.eos_token_id else "length",
            )
            for i in range(B)
        ]

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
        logits: torch.Tensor, temperature: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its log-prob, (b,) each. Greedy reports the untempered log-prob."""
        if temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            ids = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            ids = _sample(logp, generator)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def _sample(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from softmax-normalised `logp` (b, V), by inverting the CDF.

    torch.multinomial spends ~140 ms per step on 128 x 50k rows on one CPU thread
    (it draws an exponential per entry); cumsum + searchsorted takes ~25 ms. A token
    with zero probability adds nothing to the CDF, so it can never be drawn."""
    cdf = logp.exp().cumsum(dim=-1)  # (b, V)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[1] - 1)
