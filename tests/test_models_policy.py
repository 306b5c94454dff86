"""Building, saving and loading policies: determinism, atomic writes, clear load errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from policies.models import ModelLoadError, ModelSpec, build_policy, load_policy, save_policy
from tokenbridge import TokenizerLoadError, load_tokenizer
from test_models_fixtures import real_tokenizer, tiny_spec


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_build_is_sized_to_the_tokenizer_and_deterministic_in_the_seed(arch: str) -> None:
    tokenizer = real_tokenizer(tiny_spec(arch).tokenizer)
    torch.manual_seed(123)
    before = torch.rand(1)
    a = build_policy(tiny_spec(arch), tokenizer, seed=7)
    b = build_policy(tiny_spec(arch), tokenizer, seed=7)
    c = build_policy(tiny_spec(arch), tokenizer, seed=8)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before), "building must not consume the global RNG"
    assert a.get_input_embeddings().weight.shape == (len(tokenizer), 64)
    assert a.config.model_type == arch and not a.training
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.get_input_embeddings().weight, c.get_input_embeddings().weight)


def test_spec_rejects_unknown_fields_and_bad_arch() -> None:
    with pytest.raises(msgspec.ValidationError, match="n_layers"):
        msgspec.convert({"name": "m", "arch": "gpt2", "tokenizer": "gpt2", "n_layers": 2}, ModelSpec)
    spec = msgspec.convert({"name": "m", "arch": "t5", "tokenizer": "gpt2"}, ModelSpec)  # decoded: checked on use
    with pytest.raises(ModelLoadError, match="arch 't5' of model 'm' is not a causal-LM model_type"):
        build_policy(spec, real_tokenizer("gpt2"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_save_then_load_through_the_spec_is_bit_for_bit(arch: str, tmp_path: Path) -> None:
    tokenizer = real_tokenizer(tiny_spec(arch).tokenizer)
    model = build_policy(tiny_spec(arch), tokenizer, seed=3)
    with torch.no_grad():  # move off the init so a silent re-init would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    saved = save_policy(model, tokenizer, tmp_path / "ckpt", extra_files={"note.json": b"{}"})
    assert (saved / "model.safetensors").is_file() and (saved / "note.json").is_file()
    assert (saved / "tokenizer.json").is_file()
    loaded = build_policy(tiny_spec(arch, checkpoint=str(saved)), tokenizer, seed=99)
    original, again = model.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys()
    for name in original:
        assert torch.equal(original[name], again[name]), name
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temporary dirs left behind"


def test_save_replaces_an_existing_checkpoint_atomically(tmp_path: Path) -> None:
    tokenizer = real_tokenizer("gpt2")
    first = build_policy(tiny_spec("gpt2"), tokenizer, seed=1)
    second = build_policy(tiny_spec("gpt2"), tokenizer, seed=2)
    save_policy(first, tokenizer, tmp_path / "ckpt")
    save_policy(second, tokenizer, tmp_path / "ckpt")
    loaded = load_policy(tmp_path / "ckpt")
    assert torch.equal(loaded.lm_head.weight, second.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_save_leaves_nothing_that_looks_valid(tmp_path: Path) -> None:
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2"), tokenizer)
    with pytest.raises(TypeError):
        save_policy(model, tokenizer, tmp_path / "ckpt", extra_files={"bad": "not bytes"})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_missing_checkpoint_dir_is_one_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ckpt"
    with pytest.raises(ModelLoadError, match=f"checkpoint directory {missing} does not exist"):
        build_policy(tiny_spec("gpt2", checkpoint=str(missing)), real_tokenizer("gpt2"))


def test_incomplete_or_corrupt_checkpoint_dirs_are_clear_errors(tmp_path: Path) -> None:
    tokenizer = real_tokenizer("gpt2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_policy(empty)
    ckpt = save_policy(build_policy(tiny_spec("gpt2"), tokenizer), tokenizer, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_policy(ckpt)
    weights.write_bytes(data[: len(data) // 2])  # truncated, as by a crash mid-copy
    with pytest.raises(ModelLoadError, match=f"checkpoint directory {ckpt} could not be loaded"):
        load_policy(ckpt)


def test_checkpoint_of_the_wrong_family_or_vocabulary_is_refused(tmp_path: Path) -> None:
    gpt2_tok, mistral_tok = real_tokenizer("gpt2"), real_tokenizer("mistral")
    ckpt = save_policy(build_policy(tiny_spec("llama"), mistral_tok), mistral_tok, tmp_path / "llama")
    with pytest.raises(ModelLoadError, match="'llama' model but spec"):
        build_policy(tiny_spec("gpt2", checkpoint=str(ckpt)), gpt2_tok)
    with pytest.raises(ModelLoadError, match="32000 embedding rows"):
        build_policy(tiny_spec("llama", checkpoint=str(ckpt), tokenizer="gpt2"), gpt2_tok)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["vocab_size"] == 32000


def test_a_checkpoint_dir_is_also_its_tokenizer_dir(tmp_path: Path) -> None:
    tokenizer = real_tokenizer("mistral")
    ckpt = save_policy(build_policy(tiny_spec("llama"), tokenizer), tokenizer, tmp_path / "ckpt")
    again = load_tokenizer(ckpt)  # spec.tokenizer may name the checkpoint dir itself
    text = "[INST] 123 + 4567 [/INST] 4690"
    assert again.encode(text) == tokenizer.encode(text) and len(again) == len(tokenizer)
    spec = tiny_spec("llama", tokenizer=str(ckpt), checkpoint=str(ckpt))
    assert build_policy(spec, again).config.vocab_size == 32000
    with pytest.raises(TokenizerLoadError, match="no-such-dir"):
        load_tokenizer(tmp_path / "no-such-dir")
