"""Prompt templates per model family, and the token ids of prompts and completions.

A tokenizer that ships a chat template (an instruct checkpoint's directory) formats
the question as one user turn with the generation prompt; otherwise the family's
template below is used, and a causal-LM family without one gets the plain Q/A template.
A prompt's ids are the text encoded without the tokenizer's automatic special tokens,
with BOS prepended explicitly where the family uses one (a chat template writes its own),
so the result does not depend on how a tokenizer directory configured add_bos_token.
A completion is the answer text followed by EOS; generation stops at EOS.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# arch -> (template, family prepends BOS). The Llama template is Mistral-instruct's;
# Qwen's is ChatML's user turn (its tokenizers have no BOS).
_CHATML = ("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", False)
_TEMPLATES: dict[str, tuple[str, bool]] = {
    "gpt2": ("Q: {question}\nA:", False),
    "llama": ("[INST] {question} [/INST]", True),
    "mistral": ("[INST] {question} [/INST]", True),
    "qwen2": _CHATML,
    "qwen3": _CHATML,
}
_PLAIN = ("Q: {question}\nA:", True)  # any other causal-LM family without a chat template


def _template(arch: str) -> tuple[str, bool]:
    if arch in _TEMPLATES:
        return _TEMPLATES[arch]
    if arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return _PLAIN
    raise ValueError(f"no prompt template for arch {arch!r}: not a causal-LM family transformers knows")


def format_prompt(arch: str, question: str) -> str:
    """The prompt text a model of family `arch` sees for `question` (no special tokens)."""
    template, _ = _template(arch)
    return template.format(question=question)


Prompt = str | list[dict[str, str]]  # a question, or chat turns ({"role", "content"}; a system prompt first)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str | None:
    """The prompt in the tokenizer's own chat template, ending with the generation prompt (a question is one
    user turn); None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def plain_question(prompt: Prompt) -> str:
    """Chat turns as one question for a family's plain template (a tokenizer without a chat template): each
    turn's text, a blank line between them, the system prompt first."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


@dataclass(frozen=True)
class PromptFormat:
    """How one model is prompted and where its completions end: its family, a config's own ``prompt`` ("" = the
    chat template or the family's) and its ``end`` ("eos", or "newline" for a base model answering on one line)."""

    arch: str
    template: str = ""
    end: str = "eos"


def prompt_format(model) -> PromptFormat:
    """A ``[[models]]`` entry's (a ModelSpec or ModelConfig) prompt format."""
    return PromptFormat(model.arch, getattr(model, "prompt", ""), getattr(model, "end", "eos"))


def as_format(fmt: str | PromptFormat) -> PromptFormat:
    return fmt if isinstance(fmt, PromptFormat) else PromptFormat(fmt)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, fmt: str | PromptFormat, prompt: Prompt) -> list[int]:
    """Token ids of the formatted prompt: chat template if any, else the family's (BOS where it uses one). ``fmt``
    is a family (``arch``) or a model's PromptFormat: its ``template`` writes the question (the user turn's text
    under a chat template)."""
    fmt = as_format(fmt)
    if fmt.template:
        prompt = fmt.template.format(question=plain_question(prompt))
    chat = chat_prompt(tokenizer, prompt)
    if chat is not None:  # the template writes BOS itself where its family uses one
        return tokenizer.encode(chat, add_special_tokens=False)
    _, uses_bos = _template(fmt.arch)
    text = prompt if fmt.template else format_prompt(fmt.arch, plain_question(prompt))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if uses_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    return ids


def completion_text(answer_text: str) -> str:
    """The text a model should produce after the prompt: one space, then the answer.

    The same text for every family, so a peer's completion retokenized by the THL
    (decode, then encode without special tokens) gives exactly the ids this family
    generates itself: GPT-2 " 46" -> ["Ġ46"]; Mistral " 46" -> ["▁▁", "4", "6"]
    (its dummy-prefix space plus ours; the THL strips the dummy prefix when decoding).
    """
    return " " + answer_text.strip()


def completion_ids(tokenizer: PreTrainedTokenizerBase, answer_text: str, end: str = "eos") -> list[int]:
    """Token ids of the target completion for `answer_text`, ending as the model's completions end (EOS, or the
    line break of a model whose ``end`` is "newline")."""
    ids = tokenizer.encode(completion_text(answer_text), add_special_tokens=False)
    return [*ids, finish_id(tokenizer, end)]


def finish_id(tokenizer: PreTrainedTokenizerBase, end: str = "eos") -> int:
    """The token a model's finished completion ends with: EOS, or a line break (its tokenizer's own "\n")."""
    if end == "eos":
        return tokenizer.eos_token_id
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"end = {end!r}: this tokenizer writes a line break as {len(ids)} tokens, not one")
    return ids[0]


@functools.cache
def _line_break_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every token whose text is line breaks (and spaces or tabs) only: a base model ends its line with any."""
    found = []
    for token, i in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if "\n" in text and not text.strip(" \t\r\n"):
            found.append(i)
    return tuple(sorted(found))


def end_ids(tokenizer: PreTrainedTokenizerBase, end: str = "eos") -> tuple[int, ...]:
    """The tokens that end a completion: EOS, and for ``end = "newline"`` every line-break token besides."""
    if end == "eos":
        return (tokenizer.eos_token_id,)
    return (tokenizer.eos_token_id, *_line_break_tokens(tokenizer))
