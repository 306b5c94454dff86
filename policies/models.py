"""Policy models: small causal LMs built from a spec, or loaded from a save_pretrained dir.

One code path for both: `build_policy(spec, tokenizer)` builds a model of any causal-LM
family transformers knows (`spec.arch` is its model_type: gpt2, llama, qwen2, qwen3, ...)
sized to the tokenizer's vocabulary, unless `spec.checkpoint` names a directory, in which
case that checkpoint is loaded (class from its config.json, checked against the spec and
the tokenizer) instead.
`save_policy` writes the save_pretrained layout (safetensors) atomically.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from policies.spec import ModelSpec, causal_lm_families


class ModelLoadError(Exception):
    """A checkpoint directory is missing, incomplete, corrupt or does not fit the tokenizer."""


def build_policy(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> PreTrainedModel:
    """The policy for `spec`: loaded from `spec.checkpoint`, else freshly built.

    A fresh model's initialisation depends only on `spec` and `seed` (the global
    torch RNG is left untouched). Dropout is off: the log-probs a learner computes
    must be those the generator sampled from. The model is float32, in eval mode.
    """
    if spec.checkpoint is not None:
        model = load_policy(spec.checkpoint)
        _check_fits(model, spec, tokenizer, spec.checkpoint)
        return model
    if spec.arch not in causal_lm_families():  # a config is checked at load; a spec built in code is checked here
        raise ModelLoadError(f"arch {spec.arch!r} of model {spec.name!r} is not a causal-LM model_type of the "
                             "installed transformers")
    config = _config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.arch == "gpt2":
            model = GPT2LMHeadModel(config)
        elif spec.arch == "llama":
            model = LlamaForCausalLM(config)
        else:
            model = _from_config(spec, config)
    return model.float().eval()


def skeleton(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The model's modules with no weights (on the meta device): for checks that need only its structure."""
    with torch.device("meta"):
        if spec.checkpoint is not None:
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.checkpoint))
        return build_policy(spec, tokenizer)


def _from_config(spec: ModelSpec, config: PretrainedConfig) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # each family validates its config its own way
        raise ModelLoadError(_unbuildable(spec, str(exc))) from exc


def _unbuildable(spec: ModelSpec, why: str) -> str:
    return (f"arch {spec.arch!r} cannot be built from model {spec.name!r}'s sizes ({why}): "
            f"give it a checkpoint directory instead")


def _config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    vocab_size = len(tokenizer)
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_token_id(tokenizer),
        tie_word_embeddings=spec.tie_embeddings,
    )
    if spec.arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=spec.max_seq_len,
            n_embd=spec.n_embd,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
    # SwiGLU has three matrices where GPT-2's MLP has two: 8/3 * d keeps the count equal.
    intermediate = spec.intermediate_size or _round_up(8 * spec.n_embd // 3, 32)
    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=spec.n_embd,
        intermediate_size=intermediate,
        num_hidden_layers=spec.n_layer,
        num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_kv_head or spec.n_head,
        max_position_embeddings=spec.max_seq_len,
    )
    if spec.arch == "llama":
        return LlamaConfig(attention_dropout=0.0, **sizes, **special)
    return _family_config(spec, sizes, special)


def _family_config(spec: ModelSpec, sizes: dict, special: dict) -> PretrainedConfig:
    """A config of any other family from the Llama-style size names most families share.

    Families that name their sizes otherwise (or ignore them) are refused, not built at a
    size nobody asked for: load such a model from a checkpoint instead."""
    try:
        config = AutoConfig.for_model(spec.arch, **sizes, **special)
        if hasattr(config, "head_dim"):  # Qwen3 and others default to 128 whatever the width
            config.head_dim = spec.n_embd // spec.n_head
        for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
            if hasattr(config, key):
                setattr(config, key, 0.0)
    except Exception as exc:  # each family validates its config its own way
        raise ModelLoadError(_unbuildable(spec, str(exc).splitlines()[0])) from exc
    ignored = [key for key, value in sizes.items() if getattr(config, key, None) != value]
    if ignored:
        raise ModelLoadError(_unbuildable(spec, f"it ignores {', '.join(ignored)}"))
    return config


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding never reaches the loss (masked), so EOS serves where no PAD exists."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id


def load_policy(path: str | os.PathLike) -> PreTrainedModel:
    """Load a save_pretrained directory; any problem is one ModelLoadError naming the path."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"checkpoint directory {path} has no config.json (not a save_pretrained dir)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise ModelLoadError(f"checkpoint directory {path} has no weights (*.safetensors)")
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a corrupt dir
        raise ModelLoadError(f"checkpoint directory {path} could not be loaded: {exc}") from exc
    return model.eval()


def _check_fits(
    model: PreTrainedModel, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, path: str
) -> None:
    """A checkpoint whose family or vocabulary differs from the spec is a config error."""
    model_type = model.config.model_type
    if spec.arch != model_type:
        raise ModelLoadError(
            f"checkpoint {path} is a {model_type!r} model but spec {spec.name!r} says arch={spec.arch!r}"
        )
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ModelLoadError(
            f"checkpoint {path} has {rows} embedding rows but tokenizer {spec.tokenizer!r} "
            f"has {len(tokenizer)} tokens: wrong tokenizer for this checkpoint?"
        )


def save_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | os.PathLike,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write model + tokenizer (+ extra files) to `path` in save_pretrained layout.

    Atomic: everything is written to a temporary sibling directory, which is then
    renamed into place, so a crash never leaves a half-written dir that looks valid.
    An existing `path` is replaced.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # a name may hold a folder: adapter/...
            (tmp / name).write_bytes(data)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first, then removed."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rename(dst, old / dst.name)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No per-shard progress bars from transformers: the terminal belongs to the run's display."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
