"""Registry and config decoding: names, duplicates, lookup errors, TOML, adding an objective."""

from __future__ import annotations

import msgspec
import pytest
import torch

from policies import registry
from policies.objective_config import SurrogateConfig
from policies.objectives import (
    GRPOConfig,
    ObjectiveBatch,
    HACPOConfig,
    ObjectiveConfig,
    PRPConfig,
    SGTConfig,
    SGTRefConfig,
    XGRPOConfig,
    compute_loss,
    get_objective,
    grpo_objective,
    objective_names,
    register_objective,
)


def solo_batch() -> ObjectiveBatch:
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.3]], requires_grad=True)
    return ObjectiveBatch.solo(logp=logp, behav_logp=logp.detach(), mask=torch.ones(2, 2),
                               rewards=torch.tensor([1.0, 0.0]), group=torch.zeros(2, dtype=torch.long), num_groups=1)


def test_builtin_names_and_kinds():
    assert objective_names() == ["grpo", "hacpo", "prp", "sgt", "sgt_ref", "xgrpo"]
    for cfg in (GRPOConfig(), XGRPOConfig(), PRPConfig(), SGTConfig(), SGTRefConfig(), HACPOConfig()):
        assert get_objective(cfg.kind)[0] is type(cfg)


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_objective("grpo", GRPOConfig)(grpo_objective)


def test_unknown_name_lists_registered_ones():
    with pytest.raises(KeyError, match="grpo, hacpo, prp, sgt, sgt_ref, xgrpo"):
        get_objective("ppo")


def test_config_tag_must_match_name():
    with pytest.raises(ValueError, match="must be tagged 'other'"):
        register_objective("other", GRPOConfig)


def test_wrong_config_type_for_kind_is_refused():
    class Fake(msgspec.Struct):
        kind: str = "grpo"

    with pytest.raises(TypeError, match="expects a GRPOConfig"):
        compute_loss(solo_batch(), Fake(), torch.Generator())


def test_toml_decodes_into_objective_config():
    text = b'kind = "sgt"\nlambda = 0.25\naggregation = "seq_mean"\nmax_staleness = 2\n'
    cfg = msgspec.toml.decode(text, type=ObjectiveConfig)
    assert isinstance(cfg, SGTConfig) and cfg.lam == 0.25 and cfg.aggregation == "seq_mean" and cfg.kind == "sgt"
    assert msgspec.convert({"kind": "prp"}, ObjectiveConfig) == PRPConfig()
    assert msgspec.to_builtins(XGRPOConfig(leave_own_out=True))["kind"] == "xgrpo"


@pytest.mark.parametrize("table, words", [
    ({"kind": "prp", "ratio_cap": -1.0}, "ratio_cap"),
    ({"kind": "grpo", "eps_low": 1.5}, "eps_low"),
    ({"kind": "sgt", "lambda": -0.1}, "lambda"),
    ({"kind": "xgrpo", "leave_own_in": True}, "leave_own_in"),
    ({"kind": "prp", "variant": "tokens"}, "variant"),
    ({"kind": "ppo"}, "kind"),
])
def test_bad_config_names_the_field(table, words):
    with pytest.raises(msgspec.ValidationError, match=words):
        msgspec.convert(table, ObjectiveConfig)


def test_adding_an_objective_is_one_struct_one_function_one_registration():
    class ScaledGRPOConfig(SurrogateConfig, tag="scaled_grpo_test"):
        factor: float = 3.0

    @register_objective("scaled_grpo_test", ScaledGRPOConfig)
    def scaled(*, batch, config, rng):
        loss, stats = grpo_objective(batch=batch, config=config, rng=rng)
        return config.factor * loss, stats

    try:
        b = solo_batch()
        (g_base,) = torch.autograd.grad(compute_loss(b, GRPOConfig(), torch.Generator())[0], b.logp)
        (g_new,) = torch.autograd.grad(compute_loss(b, ScaledGRPOConfig(), torch.Generator())[0], b.logp)
        assert torch.allclose(g_new, 3.0 * g_base) and g_base.abs().sum() > 0
        assert "scaled_grpo_test" in objective_names()
    finally:
        registry._REGISTRY.pop("scaled_grpo_test")
