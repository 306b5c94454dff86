"""Prompt templates per model family, and the token ids of prompts and completions.

A prompt's ids are the template's text encoded without the tokenizer's automatic
special tokens, with BOS prepended explicitly where the family uses one, so the
result does not depend on how a tokenizer directory configured add_bos_token.
A completion is the answer text followed by EOS; generation stops at EOS.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# arch -> (template, family prepends BOS). The Llama template is Mistral-instruct's.
_TEMPLATES: dict[str, tuple[str, bool]] = {
    "gpt2": ("Q: {question}\nA:", False),
    "llama": ("[INST] {question} [/INST]", True),
}


def _template(arch: str) -> tuple[str, bool]:
    try:
        return _TEMPLATES[arch]
    except KeyError:
        raise ValueError(f"no prompt template for arch {arch!r}; known: {sorted(_TEMPLATES)}") from None


def format_prompt(arch: str, question: str) -> str:
    """The prompt text a model of family `arch` sees for `question` (no special tokens)."""
    template, _ = _template(arch)
    return template.format(question=question)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, arch: str, question: str) -> list[int]:
    """Token ids of the formatted prompt, with BOS first where the family uses one."""
    _, uses_bos = _template(arch)
    ids = tokenizer.encode(format_prompt(arch, question), add_special_tokens=False)
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


def completion_ids(tokenizer: PreTrainedTokenizerBase, answer_text: str) -> list[int]:
    """Token ids of the target completion for `answer_text`, ending with EOS."""
    ids = tokenizer.encode(completion_text(answer_text), add_special_tokens=False)
    return [*ids, tokenizer.eos_token_id]
