"""One contract for every generation backend: the CPU HF backend, its static-cache (GPU) code path,
and the sglang backend against a local stand-in answering with sglang's documented JSON."""

from __future__ import annotations

import base64
import contextlib
import math
import subprocess
import sys

import pytest
import torch

from policies.backend import BackendReleased, CudaHFBackend, GenerationBackend, HFBackend
from policies.models import build_policy
from policies.sglang_backend import (SglangBackend, SglangError, SglangHTTP, sample_from_output, serialize_tensors,
                                     sglang_backend)
from policies.templates import prompt_ids
from sglang_standin import StandIn
from test_models_backend import _constant_distribution
from test_models_fixtures import pad_id, real_tokenizer, scored_logprobs, tiny_spec

KINDS = ["hf", "hf_static_cache", "sglang_standin"]
QUESTIONS = ["12 + 34", "7 * 8", "123456 - 789"]


@contextlib.contextmanager
def backend_of(kind: str, model, tokenizer):
    """The backend under test and the HF model whose weights it samples from."""
    eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
    if kind == "hf":
        yield HFBackend(model, eos, pad), model
    elif kind == "hf_static_cache":  # CudaHFBackend's code path, on CPU in float32
        yield CudaHFBackend(model, eos, pad, device="cpu", dtype=torch.float32), model
    else:
        standin = StandIn(HFBackend(model, eos, pad))
        with standin as url:
            backend = SglangBackend(SglangHTTP(url, timeout_s=60), eos)  # a deterministic server: seeds hold
            backend.standin = standin  # the tests read the requests it received
            yield backend, model


@pytest.fixture
def setup(request):
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=0)
    prompts = [prompt_ids(tokenizer, "gpt2", q) for q in QUESTIONS]
    with backend_of(request.param, model, tokenizer) as (backend, held):
        yield backend, held, tokenizer, prompts


contract = pytest.mark.parametrize("setup", KINDS, indirect=True)


def assert_same_samples(a, b) -> None:
    """Same tokens and stops; log-probs to float32 noise (a static cache reduces in another order)."""
    flat_a, flat_b = [s for r in a for s in r], [s for r in b for s in r]
    assert [(s.completion_ids, s.finish_reason) for s in flat_a] == [(s.completion_ids, s.finish_reason) for s in flat_b]
    for x, y in zip(flat_a, flat_b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@contract
def test_is_a_generation_backend_and_reports_the_logprobs_of_its_weights(setup) -> None:
    backend, model, _, prompts = setup
    assert isinstance(backend, GenerationBackend) and backend.version == 0 and not backend.released
    results = backend.generate(prompts, num_samples=3, max_new_tokens=8, temperature=1.0, seed=5)
    assert [len(r) for r in results] == [3, 3, 3]
    for prompt, samples in zip(prompts, results):
        for s in samples:
            assert len(s.logprobs) == len(s.completion_ids) > 0
            expected = scored_logprobs(model, prompt, s.completion_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


@contract
def test_greedy_is_deterministic_and_a_seed_reproduces_sampling(setup) -> None:
    backend, _, _, prompts = setup
    greedy = backend.generate(prompts, 2, 6, 0.0)
    assert greedy == backend.generate(prompts, 2, 6, 0.0, seed=3) and all(a == b for a, b in greedy)
    a, b, c = (backend.generate(prompts, 4, 6, 1.0, seed=s) for s in (11, 11, 12))
    assert a == b and a != c
    assert len({tuple(s.completion_ids) for s in a[0]}) > 1, "samples of one prompt must differ"


@contract
def test_rows_stop_at_their_own_eos_which_is_kept_with_its_logprob(setup) -> None:
    backend, model, tokenizer, prompts = setup
    eos = tokenizer.eos_token_id
    _constant_distribution(model, eos, len(tokenizer), p_eos=0.3)
    samples = [s for r in backend.generate(prompts, 12, 5, 1.0, seed=0) for s in r]
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    for s in samples:
        assert eos not in s.completion_ids[:-1]
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == eos and s.logprobs[-1] == pytest.approx(math.log(0.3), abs=1e-4)
        else:
            assert len(s.completion_ids) == 5


@contract
def test_new_weights_from_tensors_change_the_samples_and_the_version(setup) -> None:
    backend, _, tokenizer, prompts = setup
    other = build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=1)
    before = backend.generate(prompts, 1, 6, 0.0)
    backend.load_state_dict(other.state_dict(), version=3)
    assert backend.version == 3
    after = backend.generate(prompts, 1, 6, 0.0)
    assert after != before
    fresh = HFBackend(other, tokenizer.eos_token_id, pad_id(tokenizer)).generate(prompts, 1, 6, 0.0)
    assert_same_samples(after, fresh)
    with pytest.raises(RuntimeError, match="Unexpected key|no such weights"):  # a name the model lacks
        backend.load_state_dict({"lm_head.weight": other.lm_head.weight, "no.such.weight": torch.zeros(2)}, version=4)
    assert backend.version == 3


@contract
def test_released_memory_refuses_work_until_resumed_then_serves_the_same_weights(setup) -> None:
    backend, _, _, prompts = setup
    before = backend.generate(prompts, 1, 6, 0.0)
    backend.release_memory()
    assert backend.released
    with pytest.raises(BackendReleased, match="resume_memory"):
        backend.generate(prompts, 1, 6, 0.0)
    with pytest.raises(BackendReleased):
        backend.load_state_dict({}, version=1)
    backend.resume_memory()
    assert not backend.released and backend.generate(prompts, 1, 6, 0.0) == before


@pytest.mark.parametrize("setup", ["sglang_standin"], indirect=True)
def test_sglang_requests_follow_the_documented_api(setup) -> None:
    backend, _, tokenizer, prompts = setup
    backend.generate(prompts[:2], 3, 4, 0.7, seed=1)
    backend.release_memory()
    backend.resume_memory()
    paths = [p for p, _ in backend.standin.requests]
    assert paths == ["/generate", "/release_memory_occupation", "/resume_memory_occupation"]
    body = backend.standin.requests[0][1]
    assert body["return_logprob"] is True and len(body["input_ids"]) == 6
    params = body["sampling_params"]
    assert {(p["temperature"], p["max_new_tokens"]) for p in params} == {(0.7, 4)}
    assert all(p["stop_token_ids"] == [tokenizer.eos_token_id] for p in params)
    assert len({p["sampling_seed"] for p in params}) == 6, "every row its own seed"


def test_the_standin_keeps_sglangs_update_rules_and_the_backend_follows_them() -> None:
    """sglang 0.5.21's rules, kept by the stand-in: an update only inside a begin/end session, one payload per
    tensor-parallel rank, a multiprocessing pickle and nothing else; the backend's updates keep them."""
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=0)
    eos = tokenizer.eos_token_id
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    standin = StandIn(HFBackend(build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=1), eos,
                                pad_id(tokenizer)), tp_size=2)
    with standin as url:
        raw = SglangHTTP(url, timeout_s=60)
        body = {"serialized_named_tensors": [serialize_tensors(named)] * 2, "weight_version": "1"}
        with pytest.raises(SglangError, match="must run between begin_weight_update"):
            raw.request("/update_weights_from_tensor", body)
        raw.request("/begin_weight_update", {})
        with pytest.raises(SglangError, match="list index out of range"):  # one payload, two ranks
            raw.request("/update_weights_from_tensor", {**body, "serialized_named_tensors": body["serialized_named_tensors"][:1]})
        from safetensors.torch import save

        bytes_payload = base64.b64encode(save(dict(named))).decode()  # plain bytes: sglang cannot unpickle them
        with pytest.raises(SglangError, match="Failed to update weights"):
            raw.request("/update_weights_from_tensor", {**body, "serialized_named_tensors": [bytes_payload] * 2})
        raw.request("/end_weight_update", {})
        assert standin.backend.version == 0  # nothing was loaded
        backend = sglang_backend(eos, "float32", url)
        backend.load_state_dict(dict(named), 3)
        paths = [p for p, _ in standin.requests[-3:]]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
        assert len(standin.requests[-2][1]["serialized_named_tensors"]) == 2  # one per rank
        assert standin.backend.version == 3 and all(torch.equal(t, standin.backend.model.state_dict()[n])
                                                    for n, t in named)


def test_an_sglang_server_that_would_not_sample_as_asked_is_said_or_refused() -> None:
    """A server without deterministic inference ignores sampling_seed: none is sent (the backend says it is not
    seeded). A server whose dtype is not the model's (sglang's "auto" serves float32 checkpoints in float16)
    is refused in one sentence."""
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2", tie_embeddings=False), tokenizer, seed=0)
    eos = tokenizer.eos_token_id
    standin = StandIn(HFBackend(model, eos, pad_id(tokenizer)), dtype="auto", deterministic=False)
    with standin as url:
        with pytest.raises(SglangError, match=r"runs --dtype auto .*float16.*start it with --dtype bfloat16"):
            sglang_backend(eos, "bfloat16", url)
        standin.info["dtype"] = "bfloat16"
        backend = sglang_backend(eos, "bfloat16", url)
        assert not backend.seeded
        backend.generate([[eos]], 2, 3, 1.0, seed=4)
        (body,) = [b for p, b in standin.requests if p == "/generate"]
        assert all("sampling_seed" not in p for p in body["sampling_params"])


def test_sglang_outputs_off_the_documented_shape_are_one_clear_error() -> None:
    ok = {"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-0.1, 2, None]], "finish_reason": {"type": "stop"}}}
    assert sample_from_output(ok, end_ids=2).completion_ids == [7, 2]
    assert sample_from_output(ok, end_ids=[3, 2]).completion_ids == [7, 2]  # a base model's line break ends a row too
    with pytest.raises(SglangError, match="was return_logprob sent"):
        sample_from_output({"meta_info": {"finish_reason": {"type": "stop"}}}, 2)
    with pytest.raises(SglangError, match="abort"):
        sample_from_output({"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}, 2)
    with pytest.raises(SglangError, match=r"not on an end token \[3\]"):
        sample_from_output(ok, end_ids=3)
    with pytest.raises(SglangError, match="cannot reach http://127.0.0.1:9"):
        SglangHTTP("http://127.0.0.1:9", timeout_s=5)


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_importing_the_project_never_imports_sglang() -> None:
    code = ("import sys, policies.sglang_backend, policies.backend, engine.roles.generator; "
            "assert 'sglang' not in sys.modules, 'sglang was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_static_cache_path_samples_what_the_dynamic_cache_samples_in_a_qwen2_model() -> None:
    tokenizer = real_tokenizer("qwen2")
    from policies.models import ModelSpec

    model = build_policy(ModelSpec(name="q", arch="qwen2", tokenizer="qwen2", n_layer=2, n_embd=64, n_head=2), tokenizer)
    noise = torch.Generator().manual_seed(0)  # seeded: what an earlier test drew must not change these weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise, dtype=p.dtype) * 0.5)
    eos = tokenizer.eos_token_id  # rows finishing mid-batch: the contract's EOS test, on gpt2
    prompts = [prompt_ids(tokenizer, "qwen2", q) for q in QUESTIONS]
    dynamic = HFBackend(model, eos, pad_id(tokenizer)).generate(prompts, 3, 8, 1.0, seed=1)
    static = CudaHFBackend(model, eos, pad_id(tokenizer), device="cpu", dtype=torch.float32).generate(
        prompts, 3, 8, 1.0, seed=1)
    for prompt, samples in zip(prompts, static):  # the static cache's log-probs are the model's own
        for s in samples:
            expected = scored_logprobs(model, prompt, s.completion_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
    # The same seed draws the same tokens, except where a draw lands within float32 noise of the boundary
    # between two neighbouring ids of the cumulative distribution (seen on one CPU: 65747 vs 65748 at the
    # last step of one row): the rows must agree up to such a flip, and at most one row may flip.
    flips = 0
    for a, b in zip((s for r in dynamic for s in r), (s for r in static for s in r)):
        at = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y), None)
        if at is None:
            assert (a.completion_ids, a.finish_reason) == (b.completion_ids, b.finish_reason)
            continue
        assert abs(a.completion_ids[at] - b.completion_ids[at]) == 1, f"a draw that is not a boundary flip at {at}"
        flips += 1
    assert flips <= 1, f"{flips} rows drew other tokens"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the bf16 static-cache backend runs only on a GPU")
def test_cuda_backend_samples_in_bf16_close_to_float32_logprobs() -> None:
    tokenizer = real_tokenizer("qwen2")
    from policies.models import ModelSpec

    model = build_policy(ModelSpec(name="q", arch="qwen2", tokenizer="qwen2", n_layer=2, n_embd=64, n_head=2), tokenizer)
    prompts = [prompt_ids(tokenizer, "qwen2", q) for q in QUESTIONS]
    backend = CudaHFBackend(model, tokenizer.eos_token_id, pad_id(tokenizer))
    assert next(backend.model.parameters()).dtype == torch.bfloat16
    results = backend.generate(prompts, 2, 8, 1.0, seed=0)
    assert all(len(s.completion_ids) == len(s.logprobs) > 0 for r in results for s in r)
    used = torch.cuda.memory_allocated()
    backend.release_memory()
    assert torch.cuda.memory_allocated() < used
    backend.resume_memory()
    assert backend.generate(prompts, 2, 8, 0.0) == backend.generate(prompts, 2, 8, 0.0)
