"""Real tokenizers and tiny real models shared by the models/tasks/warm-start tests."""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from policies.models import ModelSpec
from tokenbridge import load_tokenizer


@functools.cache
def real_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The real "gpt2" or "mistral" tokenizer from the THL's offline loader (cached per process)."""
    return load_tokenizer(name)


# The two families of the default run, at the default (tiny) size.
ARCH_TOKENIZER = {"gpt2": "gpt2", "llama": "mistral"}


def tiny_spec(arch: str, **overrides) -> ModelSpec:
    fields = dict(name=f"tiny-{arch}", arch=arch, tokenizer=ARCH_TOKENIZER[arch], n_layer=2, n_embd=64, n_head=2)
    fields.update(overrides)
    return ModelSpec(**fields)


def scored_logprobs(model, prompt: list[int], completion: list[int]):
    """The model's own (teacher-forced) log-probs of ``completion`` after ``prompt``: what a learner computes."""
    import torch

    from policies.logprobs import token_logprobs

    ids = torch.tensor([prompt + completion])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[0, len(prompt):] = True
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), target)[0, len(prompt):]


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def test_real_tokenizers_have_their_real_vocabularies() -> None:
    gpt2, mistral = real_tokenizer("gpt2"), real_tokenizer("mistral")
    assert len(gpt2) == 50257 and gpt2.eos_token_id == 50256
    assert len(mistral) == 32000 and (mistral.bos_token_id, mistral.eos_token_id) == (1, 2)
    assert gpt2.convert_ids_to_tokens(gpt2.encode(" 1234")) == ["Ġ12", "34"]
