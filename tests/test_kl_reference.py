"""The KL to the starting weights (``objective.kl_coef > 0``, TRL's ``beta``) on a real tiny model.

The learner's own step (``train_share``) with its reference (``engine.train.reference``): zero KL while the
policy is its start, a KL that grows as it moves, and a gradient that the KL term changes. A whole run of the
smoke config with kl_coef = 0.05 (tests/test_engine_run.py's dead-generator run) checks that the figure reaches
metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import copy
import functools

import msgspec
import numpy as np
import pytest
import torch

from engine.config import ConfigError, load_run_config
from engine.train import group as dp
from engine.train.batching import OwnSample, build_batch
from engine.train.optim import adamw
from engine.train.reference import Reference, starting_reference
from engine.train.step import train_share
from policies.logprobs import completion_logprobs, pack
from policies.objectives import ObjectiveConfig
from tests.enginerun import ROOT

LR, CLIP = 3e-2, 1e6  # a large step, so a few of them move the policy measurably; the clip never binds


@functools.cache
def _initial():
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    tok = load_tokenizer("gpt2")
    spec = ModelSpec(name="tiny", arch="gpt2", tokenizer="gpt2", n_layer=1, n_embd=32, n_head=2, max_seq_len=48)
    return build_policy(spec, tok, seed=3), tok.eos_token_id


def _state(lora: bool = False) -> tuple[dp.TrainState, int]:
    """A learner's state on the initial weights, its reference as the learner builds it."""
    initial, pad = _initial()
    model = copy.deepcopy(initial)
    if lora:
        from policies.lora import add_adapters
        from policies.spec import LoraSpec

        model = add_adapters(model, LoraSpec(rank=4, alpha=8.0), seed=0)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    state = dp.TrainState(model, adamw(trained, lr=LR), torch.Generator().manual_seed(0))
    state.reference = starting_reference(model, lambda: copy.deepcopy(initial))
    return state, pad


def _data(vocab: int) -> dp.StepData:
    """Three prompts of four samples each (a group shares its prompt: the shared-prompt forward), half rewarded."""
    rng = np.random.default_rng(5)
    own = []
    for p in range(3):
        prompt = rng.integers(0, vocab, 6)
        for i in range(4):
            n = 3 + (i + p) % 4
            own.append(OwnSample(prompt_ids=prompt, completion_ids=rng.integers(0, vocab, n),
                                 behaviour_logprobs=np.full(n, -3.0, np.float32), reward=float(i % 2),
                                 verified=i % 2 == 1, weight_version=0, prompt_id=p))
    return dp.StepData([0, 1, 2], own, [], {}, 0)


def _objective(kl_coef: float):
    return msgspec.convert({"kind": "grpo", "kl_coef": kl_coef}, ObjectiveConfig)


def _step(state: dp.TrainState, data: dp.StepData, pad: int, kl_coef: float) -> dict:
    return train_share(state, data, data.own, [], 0, 1, _objective(kl_coef), pad, CLIP, LR)


def _grads(state: dp.TrainState) -> list[torch.Tensor]:
    return [p.grad.clone() for p in state.params]


def _k3_per_token(state: dp.TrainState, data: dp.StepData, pad: int) -> float:
    """The k3 KL mean per own token, from the two models' log-probs computed here one sample at a time (no
    prompt shared: the step's batch shares each group's)."""
    with torch.no_grad():
        logp = torch.cat([completion_logprobs(state.model, pack([s.prompt_ids], [s.completion_ids], pad))[0]
                          for s in data.own])
        ref = torch.cat([state.reference.logprobs(pack([s.prompt_ids], [s.completion_ids], pad))[0]
                         for s in data.own])
    return float((torch.exp(ref - logp) - (ref - logp) - 1).mean())


def _started(lora: bool):
    """A learner's state (full copy or LoRA), its pad id and a step's data."""
    if lora:
        pytest.importorskip("peft")
    state, pad = _state(lora)
    return state, pad, _data(state.model.config.vocab_size)


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_the_kl_is_exactly_zero_while_the_policy_is_its_start(lora):
    state, pad, data = _started(lora)
    batch = build_batch(state.model, data.own, [], data.prompts, 0, pad, reference=state.reference)
    assert torch.equal(batch.ref_logp, batch.logp.detach()) and not batch.ref_logp.requires_grad
    plain, _ = _state(lora)
    _step(plain, data, pad, kl_coef=0.0)
    figures = _step(state, data, pad, kl_coef=0.5)
    assert figures["obj/kl"] == 0.0
    # k3's gradient at pi = pi_ref is exactly 0: the KL term leaves the first step as it is
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(state)))
    if lora:  # the reference forward switched the adapters off and on again: only they train, and still do
        trained = [n for n, p in state.model.named_parameters() if p.requires_grad]
        assert trained and all(".lora_" in n for n in trained) and state.model.training
        assert state.reference.holdings() == []  # no second copy


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_the_kl_grows_as_the_policy_moves_and_is_the_k3_mean_per_token(lora):
    state, pad, data = _started(lora)
    kls = [_step(state, data, pad, kl_coef=0.05)["obj/kl"] for _ in range(4)]
    assert kls[0] == 0.0 and min(kls[1:]) > 0.0, kls  # each figure is that of the weights before its step
    measured = _k3_per_token(state, data, pad)  # the weights the next step's figure is taken at
    assert _step(state, data, pad, kl_coef=0.05)["obj/kl"] == pytest.approx(measured, rel=1e-4)


def test_the_kl_term_changes_the_gradient_once_the_policy_moved():
    state, pad = _state()
    data = _data(state.model.config.vocab_size)
    for _ in range(3):
        _step(state, data, pad, kl_coef=0.0)  # move away from the start without the KL's pull
    grads = {}
    for coef in (0.0, 0.5, 1.0):
        moved = copy.deepcopy(state)  # the same weights, AdamW moments and RNG for each coefficient
        figures = _step(moved, data, pad, kl_coef=coef)
        grads[coef] = _grads(moved)
        assert (figures["obj/kl"] > 0.0) == (coef > 0.0)  # no reference is read at kl_coef = 0
    diff = [b - a for a, b in zip(grads[0.0], grads[0.5])]
    assert any(bool(d.abs().max() > 1e-6) for d in diff)  # the KL term pulls: a different gradient
    # ... and it is the term's: linear in kl_coef (1.0 pulls twice what 0.5 does)
    for a, half, one in zip(grads[0.0], grads[0.5], grads[1.0]):
        torch.testing.assert_close(one - a, 2 * (half - a), rtol=1e-3, atol=1e-6)


def test_the_reference_is_frozen_and_on_the_policy_device():
    state, _ = _state()
    ref = state.reference
    assert isinstance(ref, Reference) and ref.module is not state.model and not ref.module.training
    assert not any(p.requires_grad for p in ref.module.parameters())
    assert next(ref.module.parameters()).device == next(state.model.parameters()).device


def test_kl_with_sharded_learners_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r'objective\.kl_coef: > 0 is not supported with train\.sharding = "fsdp2"'):
        load_run_config(str(ROOT / "configs/smoke.toml"), ["train.sharding=fsdp2", "objective.kl_coef=0.1"])


# The whole run with kl_coef > 0 (obj/kl in metrics.jsonl and TensorBoard, across a learner's restart):
# tests/test_resume.py's test_a_dead_generator_a_killed_broker_and_a_dead_last_learner_are_replaced_and_nothing_is_lost
# carries it, sharing that run.
