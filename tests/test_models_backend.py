"""HFBackend: behaviour log-probs, greedy determinism, EOS handling, weight swaps."""

from __future__ import annotations

import math

import pytest
import torch

from policies.backend import HFBackend, Sample
from policies.logprobs import token_logprobs
from policies.models import build_policy
from policies.templates import prompt_ids
from test_models_fixtures import pad_id, real_tokenizer, tiny_spec

QUESTIONS = ["12 + 34", "7 * 8", "123456 - 789"]


def _setup(arch: str, **spec_overrides):
    tokenizer = real_tokenizer(tiny_spec(arch).tokenizer)
    model = build_policy(tiny_spec(arch, **spec_overrides), tokenizer, seed=0)
    backend = HFBackend(model, tokenizer.eos_token_id, pad_id(tokenizer))
    prompts = [prompt_ids(tokenizer, arch, q) for q in QUESTIONS]
    return tokenizer, model, backend, prompts


def _scored(model, prompt: list[int], sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """token_logprobs of prompt + completion at the completion tokens (with a tempered head)."""
    ids = torch.tensor([prompt + sample.completion_ids])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[0, len(prompt) :] = True
    head = model.get_output_embeddings()
    original = head.weight.data.clone()
    head.weight.data /= temperature  # logits / T, exactly what the sampler uses
    try:
        with torch.no_grad():
            return token_logprobs(model, ids, torch.ones_like(ids), target)[0, len(prompt) :]
    finally:
        head.weight.data.copy_(original)


def _constant_distribution(model, eos: int, vocab: int, p_eos: float) -> None:
    """Make every step's next-token distribution p(EOS) = p_eos, the rest uniform."""
    with torch.no_grad():  # a constant final hidden state h = e_0, whatever the input
        h = torch.zeros(model.config.n_embd)
        h[0] = 1.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(h)
        model.lm_head.weight.zero_()  # all logits 0 except EOS's
        model.lm_head.weight[eos, 0] = math.log(p_eos * (vocab - 1) / (1 - p_eos))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_behaviour_logprobs_equal_token_logprobs_of_the_same_sequence(arch: str) -> None:
    _, model, backend, prompts = _setup(arch)
    results = backend.generate(prompts, num_samples=3, max_new_tokens=10, temperature=1.0, seed=5)
    assert [len(r) for r in results] == [3, 3, 3]
    for prompt, samples in zip(prompts, results):
        for sample in samples:
            assert len(sample.logprobs) == len(sample.completion_ids) > 0
            expected = _scored(model, prompt, sample)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


def test_a_prompt_runs_once_for_all_its_samples() -> None:
    _, model, backend, prompts = _setup("llama")
    rows: list[int] = []  # the batch of each forward through the embedding
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    results = backend.generate([prompts[0], prompts[1], prompts[0]], num_samples=4, max_new_tokens=3,
                               temperature=1.0, seed=3)
    assert rows[0] == 2 and rows[1] == 12  # two distinct prompts' forward, then a row per sample
    assert [len(r) for r in results] == [4, 4, 4]
    assert len({tuple(s.completion_ids) for r in results for s in r}) > 4  # each row draws its own


def test_logprobs_are_those_of_the_tempered_distribution() -> None:
    _, model, backend, prompts = _setup("gpt2", tie_embeddings=False)
    (samples,) = backend.generate(prompts[:1], num_samples=2, max_new_tokens=6, temperature=0.5, seed=1)
    for sample in samples:
        expected = _scored(model, prompts[0], sample, temperature=0.5)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_is_deterministic_and_batching_does_not_change_it(arch: str) -> None:
    _, _, backend, prompts = _setup(arch)
    first = backend.generate(prompts, num_samples=2, max_new_tokens=8, temperature=0.0)
    second = backend.generate(prompts, num_samples=2, max_new_tokens=8, temperature=0.0, seed=9)
    assert first == second
    for a, b in first:
        assert a == b
    alone = [backend.generate([p], 1, 8, 0.0)[0][0] for p in prompts]  # no padding at all
    for (batched, _), single in zip(first, alone):
        assert batched.completion_ids == single.completion_ids
        torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(single.logprobs), atol=1e-5, rtol=0)


def test_seed_makes_sampling_reproducible() -> None:
    _, _, backend, prompts = _setup("gpt2")
    a = backend.generate(prompts, 4, 8, 1.0, seed=11)
    b = backend.generate(prompts, 4, 8, 1.0, seed=11)
    c = backend.generate(prompts, 4, 8, 1.0, seed=12)
    assert a == b and a != c
    assert len({tuple(s.completion_ids) for s in a[0]}) > 1, "samples of one prompt should differ"


def test_each_sequence_stops_at_its_own_eos_which_is_kept_with_its_logprob() -> None:
    tokenizer, model, backend, prompts = _setup("gpt2", tie_embeddings=False)
    eos, p_eos = tokenizer.eos_token_id, 0.3
    _constant_distribution(model, eos, len(tokenizer), p_eos)
    results = backend.generate(prompts, num_samples=20, max_new_tokens=6, temperature=1.0, seed=0)
    samples = [s for r in results for s in r]
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    lengths = {len(s.completion_ids) for s in samples}
    assert len(lengths) > 2, "rows must stop independently"
    for s in samples:
        assert eos not in s.completion_ids[:-1]
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == eos
            assert s.logprobs[-1] == pytest.approx(math.log(p_eos), abs=1e-4)
        else:
            assert len(s.completion_ids) == 6 and s.completion_ids[-1] != eos


def test_samples_follow_the_distribution() -> None:
    tokenizer, model, backend, prompts = _setup("gpt2", tie_embeddings=False)
    _constant_distribution(model, tokenizer.eos_token_id, len(tokenizer), p_eos=0.3)
    results = backend.generate(prompts, num_samples=300, max_new_tokens=1, temperature=1.0, seed=0)
    first = [s.completion_ids[0] for r in results for s in r]
    assert abs(first.count(tokenizer.eos_token_id) / len(first) - 0.3) < 0.06  # ~3 binomial sd
    others = [t for t in first if t != tokenizer.eos_token_id]
    assert len(set(others)) > 0.9 * len(others), "the rest is uniform over 50k tokens: few repeats"


def test_load_state_dict_swaps_weights_and_version() -> None:
    tokenizer, _, backend, prompts = _setup("llama")
    other = build_policy(tiny_spec("llama"), tokenizer, seed=1)
    before = backend.generate(prompts, 1, 8, 0.0)
    backend.load_state_dict(other.state_dict(), version=3)
    assert backend.version == 3
    after = backend.generate(prompts, 1, 8, 0.0)
    assert before != after
    third = build_policy(tiny_spec("llama"), tokenizer, seed=2).state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):  # a name the model lacks: nothing is copied
        backend.load_state_dict({**third, "no.such.weight": torch.zeros(1)}, version=4)
    assert backend.version == 3 and backend.generate(prompts, 1, 8, 0.0) == after
