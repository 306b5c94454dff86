"""top_p and top_k (train.top_p, train.top_k): they change what the HF backends sample, each Sample's log-probs are
those of the truncated, renormalised distribution it was drawn from (the learner's behaviour log-probs), nothing
changes while they are off, and what cannot honour them (sglang, a bad value) refuses in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, load_run_config
from policies.backend import CudaHFBackend, HFBackend, Sample
from policies.models import build_policy
from policies.sglang_backend import SglangBackend, SglangHTTP
from policies.templates import prompt_ids
from sglang_standin import StandIn
from test_models_fixtures import pad_id, real_tokenizer, scored_logprobs, tiny_spec

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.toml"
QUESTIONS = ["12 + 34", "7 * 8", "123456 - 789"]
KINDS = ["hf", "hf_static_cache"]


@pytest.fixture(scope="module")
def peaked():
    """A tiny model whose next-token distributions are peaked, as a trained model's are (a random one's are near
    uniform over 50k tokens): a few dozen tokens hold a third of the mass, so a nucleus is small and a
    sampler that ignored it would draw outside it most of the time."""
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    return model, tokenizer, [prompt_ids(tokenizer, "gpt2", q) for q in QUESTIONS]


def _backend(kind: str, model, tokenizer) -> HFBackend:
    eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
    if kind == "hf":
        return HFBackend(model, eos, pad)
    return CudaHFBackend(model, eos, pad, device="cpu", dtype=torch.float32)  # the GPU code path, on CPU


def _kept(probs: torch.Tensor, top_p: float, top_k: int) -> dict[int, float]:
    """Token -> renormalised probability, for the tokens top-k then top-p keep of ``probs`` (V,): a plain walk
    down the ranking, independent of the backend's masks."""
    values, order = probs.double().sort(descending=True)
    if top_k:
        values, order = values[:top_k] / values[:top_k].sum(), order[:top_k]
    kept, mass = {}, 0.0
    for value, token in zip(values.tolist(), order.tolist()):
        if mass >= top_p:  # the tokens above already hold top_p: the nucleus is complete
            break
        kept[token], mass = value, mass + value
    return {token: value / mass for token, value in kept.items()}


def _step_probs(model, prompt: list[int], sample: Sample, temperature: float) -> torch.Tensor:
    """(n, V): the tempered next-token distribution before each completion token, from one uncached forward."""
    ids = torch.tensor([prompt + sample.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_top_k_1_samples_the_greedy_completion_with_log_prob_0(peaked, kind) -> None:
    model, tokenizer, prompts = peaked
    backend = _backend(kind, model, tokenizer)
    greedy = backend.generate(prompts, 1, 8, 0.0)
    sampled = backend.generate(prompts, 4, 8, 1.0, seed=3, top_k=1)
    for (best,), samples in zip(greedy, sampled):
        for sample in samples:
            assert (sample.completion_ids, sample.finish_reason) == (best.completion_ids, best.finish_reason)
            assert sample.logprobs == [0.0] * len(sample.completion_ids)  # the one token kept holds all the mass
    untruncated = backend.generate(prompts, 4, 8, 1.0, seed=3)  # the same draws, the whole distribution
    assert any(s.completion_ids != best.completion_ids for (best,), r in zip(greedy, untruncated) for s in r)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("top_p, top_k, temperature", [(0.3, 0, 1.0), (1.0, 5, 1.0), (0.5, 40, 0.7)])
def test_every_token_is_in_the_truncated_set_and_its_log_prob_is_of_the_renormalised_distribution(
        peaked, kind, top_p, top_k, temperature) -> None:
    model, tokenizer, prompts = peaked
    results = _backend(kind, model, tokenizer).generate(prompts, 3, 5, temperature, seed=7, top_p=top_p, top_k=top_k)
    drawn = 0
    for prompt, samples in zip(prompts, results):
        for sample in samples:
            for probs, token, logprob in zip(_step_probs(model, prompt, sample, temperature), sample.completion_ids,
                                             sample.logprobs):
                kept = _kept(probs, top_p, top_k)
                assert token in kept, f"token {token} is outside the {len(kept)} kept by top_p={top_p}, top_k={top_k}"
                assert len(kept) < probs.shape[0] / 100  # the truncation took something away
                assert logprob == pytest.approx(torch.tensor(kept[token]).log().item(), abs=1e-4)
                drawn += 1
    assert drawn >= 3 * 3  # at least a token from each sample was checked


@pytest.mark.parametrize("kind", KINDS)
def test_off_top_p_and_top_k_sample_as_before(peaked, kind) -> None:
    """top_p=1, top_k=0 (and a top_k of the whole vocabulary) change no draw of a seed, and the log-probs stay
    those of the whole tempered distribution."""
    model, tokenizer, prompts = peaked
    backend = _backend(kind, model, tokenizer)
    before = backend.generate(prompts, 4, 8, 0.8, seed=11)
    assert backend.generate(prompts, 4, 8, 0.8, seed=11, top_p=1.0, top_k=0) == before
    assert backend.generate(prompts, 4, 8, 0.8, seed=11, top_k=len(tokenizer)) == before
    head = model.lm_head.weight.data.clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.div_(0.8)  # logits / T: the distribution sampled from, untruncated
        for prompt, samples in zip(prompts, before):
            for sample in samples:
                expected = scored_logprobs(model, prompt, sample.completion_ids)
                torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        model.lm_head.weight.data.copy_(head)


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, overrides)
    said = str(err.value)
    assert "\n" not in said, said
    return said


@pytest.mark.parametrize("override, key", [("train.top_p=0", "train.top_p"), ("train.top_p=1.5", "train.top_p"),
                                           ("train.top_k=-1", "train.top_k")])
def test_a_bad_value_is_refused_in_one_line_naming_the_key(override, key) -> None:
    assert key in _refused([override])


@pytest.mark.parametrize("override, key", [("train.top_p=0.9", "train.top_p"), ("train.top_k=20", "train.top_k")])
def test_sglang_refuses_top_p_and_top_k_in_one_line(override, key) -> None:
    sglang = "models.0.generation={backend='sglang', sglang_url='http://127.0.0.1:9'}"
    said = _refused([sglang, override])
    assert f'{key}: is not supported with models.0.generation.backend = "sglang"' in said, said
    cfg = load_run_config(SMOKE, ["train.top_p=0.9", "train.top_k=20"])  # the hf backends take them
    assert (cfg.train.top_p, cfg.train.top_k) == (0.9, 20)


def test_the_backends_refuse_a_bad_value_or_a_truncation_they_cannot_report(peaked) -> None:
    model, tokenizer, prompts = peaked
    backend = HFBackend(model, tokenizer.eos_token_id, pad_id(tokenizer))
    for kwargs, said in (({"top_p": 0.0}, "top_p must be in (0, 1]"), ({"top_k": -2}, "top_k must be >= 0")):
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace("]", r"\]")):
            backend.generate(prompts, 1, 4, 1.0, **kwargs)
    standin = StandIn(backend)
    with standin as url:
        sglang = SglangBackend(SglangHTTP(url, timeout_s=60), tokenizer.eos_token_id)
        with pytest.raises(ValueError, match="untruncated distribution"):
            sglang.generate(prompts, 2, 4, 1.0, seed=0, top_p=0.9)
        assert not [path for path, _ in standin.requests if path == "/generate"]  # refused before asking
        greedy = sglang.generate(prompts, 1, 4, 0.0, top_k=5)  # greedy: nothing to truncate, nothing refused
        plain = backend.generate(prompts, 1, 4, 0.0)
        assert [s.completion_ids for (s,) in greedy] == [s.completion_ids for (s,) in plain]
