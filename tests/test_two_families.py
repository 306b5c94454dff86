"""Gemma 3 270M (base, 262,144-token SentencePiece, BOS, digits one by one) beside SmolLM2-135M-Instruct (49,152-token
byte-level BPE, a chat template): each prompted in its own format, a base model's completion ending at its line
break, and the THL between the two real vocabularies both ways (tests/data holds both tokenizers)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.train.ingest import Ingest
from exchange.protocol import SCHEMA_VERSION, Experience, pack_floats, pack_ids
from policies.backend import HFBackend
from policies.models import build_policy
from policies.spec import ModelSpec
from policies.templates import PromptFormat, completion_ids, end_ids, finish_id, prompt_ids
from realtok import load_test_tokenizer
from tasks.registry import ArithmeticConfig, make_task
from test_models_fixtures import real_tokenizer, tiny_spec
from tokenbridge import Bridge

G = 2
SHOTS = "3 + 4 = 7\n12 - 5 = 7\n{question}"
GEMMA = ModelSpec(name="gemma", arch="gemma3_text", tokenizer="", prompt=SHOTS, end="newline")
SMOLLM2 = ModelSpec(name="smollm2", arch="llama", tokenizer="")


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tok") / "thl"
    return load_test_tokenizer("gemma3", cache), load_test_tokenizer("smollm2", cache)


def test_each_model_is_prompted_in_its_own_format(toks):
    gemma, smol = toks
    ids = prompt_ids(gemma, PromptFormat("gemma3_text", SHOTS, "newline"), "20 + 22 =")
    assert ids[0] == gemma.bos_token_id == 2 and ids.count(2) == 1  # one BOS, written by us
    assert gemma.decode(ids[1:]) == "3 + 4 = 7\n12 - 5 = 7\n20 + 22 ="
    assert gemma.convert_ids_to_tokens(gemma.encode(" 12345 + 678", add_special_tokens=False)) == \
        ["▁", "1", "2", "3", "4", "5", "▁+", "▁", "6", "7", "8"]  # digits one by one
    # (the shipped SmolLM2 tokenizer carries no chat template: its family's BOS, then the text as the prompt says)
    own = prompt_ids(smol, PromptFormat("llama", "Solve: {question}"), "20 + 22 =")
    assert own[0] == smol.bos_token_id and smol.decode(own[1:]) == "Solve: 20 + 22 ="
    assert smol.decode(prompt_ids(smol, "llama", "20 + 22 =")[1:]) == "[INST] 20 + 22 = [/INST]"  # the family's


def test_a_base_models_completion_ends_at_a_line_break(toks):
    gemma, smol = toks
    breaks = end_ids(gemma, "newline")
    assert {gemma.eos_token_id, 107, 108} <= set(breaks)  # <eos>, "\n", "\n\n"
    assert all(not gemma.decode([i]).strip() for i in breaks if i != gemma.eos_token_id)
    assert finish_id(gemma, "newline") == 107 and end_ids(smol) == (smol.eos_token_id,)
    assert completion_ids(gemma, "42", "newline")[-1] == 107 and completion_ids(smol, "42")[-1] == smol.eos_token_id


def test_the_backend_stops_a_row_on_any_end_token_and_says_so():
    """A tiny model's greedy first token declared an end token: every row stops there, finished ("stop")."""
    tok = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2"), tok, seed=0)
    prompts = [[15496, 995], [40, 1101, 257]]
    free = HFBackend(model, tok.eos_token_id, tok.eos_token_id).generate(prompts, 1, 6, 0.0, seed=0)
    firsts = tuple({row[0].completion_ids[0] for row in free})
    stopped = HFBackend(model, tok.eos_token_id, tok.eos_token_id, stop_ids=firsts).generate(prompts, 1, 6, 0.0, seed=0)
    for (sample,), (whole,) in zip(stopped, free):
        assert sample.completion_ids == whole.completion_ids[:1] and sample.finish_reason == "stop"
        assert sample.logprobs == whole.logprobs[:1]


@pytest.mark.parametrize("text", ["7", " 42", " 12345 + 678 = 13023", "8 - 3 = 5. So the answer is 5.",
                                  "Hello wörld 🙂\tdone", "ÿ\u00a0x  y"])
def test_the_thl_bridges_the_two_vocabularies_both_ways_exactly(toks, text):
    """Text and the destination's own ids, both ways, EOS to EOS; what is not one-to-one is the residual."""
    gemma, smol = toks
    for src, dst in ((gemma, smol), (smol, gemma)):
        out = Bridge(src, dst)(src.encode(text, add_special_tokens=False) + [src.eos_token_id])
        assert out.text == text and out.dst_ids[0] != dst.bos_token_id  # no BOS crosses: the receiver writes its own
        assert list(out.dst_ids) == dst.encode(text, add_special_tokens=False) + [dst.eos_token_id]
        assert 0.0 <= out.residual <= 1.0
    digits = Bridge(gemma, smol)(gemma.encode(" 17 + 25 = 42", add_special_tokens=False) + [1])
    assert digits.residual == 0.0  # both split digits one by one: every token one-to-one
    nbsp = Bridge(gemma, smol)(gemma.encode("ÿ\u00a0x", add_special_tokens=False) + [1])
    assert gemma.convert_ids_to_tokens(gemma.encode("\u00a0", add_special_tokens=False)) == ["<0xC2>", "<0xA0>"]
    assert nbsp.text == "ÿ\u00a0x" and nbsp.residual > 0  # Gemma's byte fallback: two tokens for one character


def _exp(model: str, ids: list[int], prompt: int, k: int) -> Experience:
    return Experience(schema=SCHEMA_VERSION, run_id="t", experience_id=f"{model}/{prompt}/{k}", model=model,
                      task="arithmetic", prompt_id=prompt, sample_index=k, group_size=G, weight_version=0,
                      prompt_ids=pack_ids([1, 2]), completion_ids=pack_ids(ids),
                      behaviour_logprobs=pack_floats([-0.5] * len(ids)), completion_text="", reward=1.0,
                      verified=True, finish_reason="stop", created_at=0.0, generated_at=0.0)


def test_a_finished_answer_crosses_as_a_finished_answer_each_way(toks):
    """Gemma's answer ends on its line break; SmolLM2 receives it ending with its own EOS. SmolLM2's ends with
    <|im_end|>; Gemma receives it ending with its line break, as its own answers end, in its own prompt format."""
    gemma, smol = toks
    task = make_task(ArithmeticConfig(min_digits=1, max_digits=2, ops=["+"]))
    at_smol = Ingest(SMOLLM2, smol, {"gemma": gemma}, task, G, peer_ends={"gemma": "newline"})
    at_gemma = Ingest(GEMMA, gemma, {"smollm2": smol}, task, G, peer_ends={"smollm2": "eos"})
    gemma_answer = gemma.encode(" 42", add_special_tokens=False) + [107]
    smol_answer = smol.encode(" 42", add_special_tokens=False) + [smol.eos_token_id]
    for k in range(G):
        at_smol.add(_exp("gemma", gemma_answer, 0, k))
        at_gemma.add(_exp("smollm2", smol_answer, 0, k))
    (got_smol, *_), (got_gemma, *_) = at_smol.peers[0], at_gemma.peers[0]
    assert list(got_smol.completion_ids) == smol.encode(" 42", add_special_tokens=False) + [smol.eos_token_id]
    assert list(got_gemma.completion_ids) == gemma.encode(" 42", add_special_tokens=False) + [107]
    assert np.isclose(got_smol.behaviour_logprobs.sum(), -0.5 * len(gemma_answer))  # the end's log-prob kept
    prompt = gemma.decode(got_gemma.prompt_ids[1:])
    assert got_gemma.prompt_ids[0] == 2 and prompt.startswith("3 + 4 = 7\n12 - 5 = 7\n")  # Gemma's own format
    reference = at_gemma.reference_samples([0])[0]
    assert reference.completion_ids[-1] == 107  # the answer key ends as Gemma's answers do
