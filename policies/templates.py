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


def prompt_ids(tokenizer: PreTrainedTokenizerBase, arch: str, prompt: Prompt) -> list[int]:
    """Token ids of the formatted prompt: chat template if any, else the family's (BOS where it uses one)."""
    chat = chat_prompt(tokenizer, prompt)
    if chat is not None:  # the template writes BOS itself where its family uses one
        return tokenizer.encode(chat, add_special_tokens=False)
    _, uses_bos = _template(arch)
    ids = tokenizer.encode(format_prompt(arch, plain_question(prompt)), add_special_tokens=False)
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
