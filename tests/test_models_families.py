"""Any HF causal LM: tiny random checkpoints of several families built, saved, reloaded and sampled; chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.backend import HFBackend
from policies.models import ModelLoadError, ModelSpec, build_policy, save_policy
from policies.templates import prompt_ids
from tokenbridge import load_tokenizer
from test_models_fixtures import pad_id, real_tokenizer, scored_logprobs

FAMILY_TOKENIZER = {"gpt2": "gpt2", "llama": "mistral", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "mistral"}
CHATML = (
    "<|im_start|>system\nYou add numbers.<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _spec(arch: str, **overrides) -> ModelSpec:
    fields = dict(name=f"tiny-{arch}", arch=arch, tokenizer=FAMILY_TOKENIZER[arch], n_layer=2, n_embd=64, n_head=2)
    return ModelSpec(**{**fields, **overrides})


def _tokenizer_dir_with_template(name: str, template: str, path: Path):
    """A copy of a real tokenizer, saved with a chat template, as an instruct checkpoint ships it."""
    tokenizer = load_tokenizer(name)
    tokenizer.save_pretrained(path)
    copy = load_tokenizer(path)
    copy.chat_template = template
    copy.save_pretrained(path)
    return load_tokenizer(path)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3"])
def test_a_saved_checkpoint_of_each_family_reloads_from_its_own_dir_and_samples_the_same(arch: str, tmp_path) -> None:
    tokenizer = real_tokenizer(FAMILY_TOKENIZER[arch])
    model = build_policy(_spec(arch), tokenizer, seed=4)
    with torch.no_grad():  # move off the init so a silent re-init would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = save_policy(model, tokenizer, tmp_path / arch)
    again_tok = load_tokenizer(ckpt)  # the tokenizer from the same directory
    loaded = build_policy(_spec(arch, tokenizer=str(ckpt), checkpoint=str(ckpt)), again_tok)
    assert loaded.config.model_type == arch and type(loaded) is type(model)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    prompts = [prompt_ids(again_tok, arch, q) for q in ["12 + 34", "7 * 8"]]
    assert prompts == [prompt_ids(tokenizer, arch, q) for q in ["12 + 34", "7 * 8"]]
    results = [
        HFBackend(m, tok.eos_token_id, pad_id(tok)).generate(prompts, 2, 6, 1.0, seed=3)
        for m, tok in ((model, tokenizer), (loaded, again_tok))
    ]
    assert results[0] == results[1]
    for prompt, samples in zip(prompts, results[1]):
        for s in samples:  # the sampler's log-probs are the learner's log-probs of the same tokens
            scored = scored_logprobs(loaded, prompt, s.completion_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), scored, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "olmo"])
def test_families_beyond_gpt2_and_llama_build_from_the_spec_sizes(arch: str) -> None:
    tokenizer = real_tokenizer("qwen2")
    model = build_policy(ModelSpec(name="m", arch=arch, tokenizer="qwen2", n_layer=2, n_embd=64, n_head=2), tokenizer)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (arch, 64, 2, len(tokenizer))
    ids = torch.tensor([prompt_ids(tokenizer, arch, "1 + 1")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_a_family_that_cannot_take_the_spec_sizes_or_is_not_a_causal_lm_is_one_clear_error() -> None:
    tokenizer = real_tokenizer("gpt2")
    with pytest.raises(ModelLoadError, match="arch 'rwkv' cannot be built from model 'm''s sizes .*checkpoint"):
        build_policy(ModelSpec(name="m", arch="rwkv", tokenizer="gpt2", n_layer=1, n_embd=64, n_head=2), tokenizer)
    with pytest.raises(ModelLoadError, match="arch 'vit' of model 'm' is not a causal-LM model_type"):
        build_policy(ModelSpec(name="m", arch="vit", tokenizer="gpt2"), tokenizer)


def test_checkpoint_family_must_match_the_spec_arch(tmp_path) -> None:
    tokenizer = real_tokenizer("qwen2")
    ckpt = save_policy(build_policy(_spec("qwen2"), tokenizer), tokenizer, tmp_path / "q")
    with pytest.raises(ModelLoadError, match="is a 'qwen2' model but spec 'tiny-qwen3' says arch='qwen3'"):
        build_policy(_spec("qwen3", checkpoint=str(ckpt)), tokenizer)


def test_a_tokenizer_with_a_chat_template_formats_the_question_as_one_user_turn(tmp_path) -> None:
    tokenizer = _tokenizer_dir_with_template("qwen2", CHATML, tmp_path / "qwen")
    ids = prompt_ids(tokenizer, "qwen2", "12 + 34")
    expected = "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n12 + 34<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # a special token, not its characters
    plain = prompt_ids(real_tokenizer("qwen2"), "qwen2", "12 + 34")  # no template: the family's ChatML turn
    assert real_tokenizer("qwen2").decode(plain) == "<|im_start|>user\n12 + 34<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_that_writes_bos_gets_exactly_one(tmp_path) -> None:
    tokenizer = _tokenizer_dir_with_template(
        "mistral", "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}", tmp_path / "m"
    )
    ids = prompt_ids(tokenizer, "llama", "7 * 8")
    assert ids == prompt_ids(real_tokenizer("mistral"), "llama", "7 * 8")  # same as the family template
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_a_family_without_its_own_template_gets_the_plain_one() -> None:
    tokenizer = real_tokenizer("mistral")
    ids = prompt_ids(tokenizer, "phi3", "2 + 2")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "Q: 2 + 2\nA:"
