"""Prompt templates and completion ids with the real tokenizers."""

from __future__ import annotations

import pytest

from policies.templates import completion_ids, format_prompt, prompt_ids
from test_models_fixtures import real_tokenizer


def test_each_family_has_its_template_and_bos_rule() -> None:
    gpt2, mistral = real_tokenizer("gpt2"), real_tokenizer("mistral")
    assert format_prompt("gpt2", "12 + 34") == "Q: 12 + 34\nA:"
    assert format_prompt("llama", "12 + 34") == "[INST] 12 + 34 [/INST]"
    g = prompt_ids(gpt2, "gpt2", "12 + 34")
    m = prompt_ids(mistral, "llama", "12 + 34")
    assert gpt2.bos_token_id not in g and gpt2.decode(g) == "Q: 12 + 34\nA:"
    assert m[0] == mistral.bos_token_id and m.count(mistral.bos_token_id) == 1
    assert mistral.decode(m[1:]) == "[INST] 12 + 34 [/INST]"
    with pytest.raises(ValueError, match="no prompt template for arch 't5'"):
        format_prompt("t5", "x")


def test_completions_end_with_eos_and_decode_to_the_same_text_in_both_families() -> None:
    gpt2, mistral = real_tokenizer("gpt2"), real_tokenizer("mistral")
    g, m = completion_ids(gpt2, "1234"), completion_ids(mistral, "1234")
    assert g[-1] == gpt2.eos_token_id and m[-1] == mistral.eos_token_id
    assert gpt2.convert_ids_to_tokens(g[:-1]) == ["Ġ12", "34"]  # BPE merges digits
    assert mistral.convert_ids_to_tokens(m[:-1])[1:] == ["1", "2", "3", "4"]  # SentencePiece splits them
    assert gpt2.decode(g, skip_special_tokens=True).strip() == "1234"
    assert mistral.decode(m, skip_special_tokens=True).strip() == "1234"
