"""What a model is, as a config names it: its family, tokenizer and size, and its LoRA adapters.

Plain msgspec Structs with no torch or transformers behind them, so a run config decodes (and a
mistake in it is reported) in a fraction of a second; ``policies.models`` and ``policies.lora``
build from them. ``arch`` is checked against the installed transformers by ``causal_lm_families``
in the config's validation, which reads transformers' table of families without importing it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What model to train: its family, tokenizer and size (or a checkpoint to load)."""

    name: str  # unique per run: names the model's topics, metrics and run-dir files
    # the model_type (config.json) of a causal LM: picks the model class and the prompt template; "" = the
    # checkpoint's own (a run config fills it in when it loads)
    arch: str = ""
    # a tokenbridge name ("gpt2", "mistral", "qwen2") or a tokenizer dir; "" = the checkpoint's own
    tokenizer: str = ""
    n_layer: int = 2  # decoder blocks of a model built from this spec (not read with a checkpoint)
    n_embd: int = 128  # hidden size of a built model
    n_head: int = 4  # attention heads of a built model
    max_seq_len: int = 128  # prompt + completion; sizes GPT-2's learned position table
    n_kv_head: int | None = None  # not gpt2: grouped-query attention; None = n_head
    intermediate_size: int | None = None  # not gpt2: MLP width; None = GPT-2's parameter count
    tie_embeddings: bool = True  # the vocab matrix dominates tiny models: share it once
    # loaded instead of built: a save_pretrained dir, a .gguf file, pkg:PACKAGE/file.gguf or a Hub id in the Hub's
    # cache (policies.sources); a loaded config holds the directory it resolved to
    checkpoint: str | None = None
    # how the task's question is written for this model: a text holding {question} once, e.g. solved examples
    # then "{question}" for a base model (no chat template); with a chat template it is the user turn's text.
    # "" = the chat template, else the family's plain template ("Q: {question}\nA:")
    prompt: str = ""
    # what ends a completion besides EOS: "newline" (a token of line breaks only) for a base model that answers
    # on one line and goes on to a next question rather than writing EOS
    end: Literal["eos", "newline"] = "eos"

    def __post_init__(self) -> None:
        if self.prompt and (self.prompt.count("{question}") != 1 or self.prompt.count("{") != 1):
            raise ValueError(f"prompt {self.prompt[:40]!r}...: must hold {{question}} once and no other braces")


class LoraSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`[models.lora]`: adapters of rank `rank` on the `targets` modules, scaled by alpha / rank."""

    rank: Annotated[int, Meta(ge=1)] = 8  # rank of each adapter
    alpha: Annotated[float, Meta(gt=0)] = 16.0  # adapter scale: the adapters' update is scaled by alpha / rank
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0  # dropout on the adapters' input while training
    targets: list[str] = []  # module names (e.g. ["q_proj", "v_proj"]); [] = peft's default for the family


@functools.cache
def causal_lm_families() -> list[str]:
    """Every model_type AutoModelForCausalLM can build.

    Read from the installed transformers' own table without importing it: importing the table imports
    torch (3 s of CPU in the launcher, which checks configs and needs neither); a transformers whose
    table is no longer a plain literal is imported instead."""
    names = _literal_mapping_keys("models/auto/modeling_auto.py", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if names is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        names = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return sorted(names)


def _literal_mapping_keys(relative: str, name: str) -> list[str] | None:
    """The keys of ``name = OrderedDict([(key, value), ...])`` in a transformers source file, or None."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / relative).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
                and isinstance(node.value, ast.Call) and len(node.value.args) == 1):
            try:
                pairs = ast.literal_eval(node.value.args[0])
            except ValueError:
                return None
            return [key for key, _ in pairs]
    return None
