"""Realistic example messages for tests, benchmarks and docs (no randomness without a seed)."""

from __future__ import annotations

import numpy as np

from exchange.protocol import SCHEMA_VERSION, Experience, pack_floats, pack_ids

_WORDS = ["the", "answer", "is", "therefore", "we", "add", "12", "and", "30", "to", "get", "42", "so", "x", "="]


def make_experience(
    index: int,
    model: str = "m0",
    *,
    rng: np.random.Generator | None = None,
    prompt_tokens: int = 128,
    completion_tokens: int = 256,
    text_chars: int = 1000,
    group_size: int = 16,
    run_id: str = "run",
) -> Experience:
    """Experience number ``index`` of ``model``: prompt ``index // group_size``, sample ``index % group_size``."""
    rng = rng or np.random.default_rng(index)
    prompt_id, sample = divmod(index, group_size)
    text = " ".join(rng.choice(_WORDS, text_chars // 3 + 1))[:text_chars]
    return Experience(
        SCHEMA_VERSION, run_id, f"{model}/{prompt_id}/{sample}/g0", model, "arith", prompt_id, sample, group_size,
        weight_version=3,
        prompt_ids=pack_ids(rng.integers(0, 150_000, prompt_tokens)),
        completion_ids=pack_ids(rng.integers(0, 150_000, completion_tokens)),
        behaviour_logprobs=pack_floats(-rng.exponential(0.5, completion_tokens)),
        completion_text=text, reward=float(rng.random() < 0.5), verified=True, finish_reason="stop",
        created_at=1.7e9 + index, generated_at=1.7e9 + index + 0.5,
    )


def make_experiences(n: int, models: tuple[str, ...] = ("m0", "m1"), seed: int = 0, **kw) -> list[Experience]:
    """``n`` experiences, models taking turns, deterministic for a seed."""
    rng = np.random.default_rng(seed)
    return [make_experience(i, models[i % len(models)], rng=rng, **kw) for i in range(n)]
