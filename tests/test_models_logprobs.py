"""token_logprobs: equal to the full-vocabulary reference, padding-invariant, differentiable; a group's shared
prompt run once by completion_logprobs, to the same log-probs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policies.logprobs import Packed, completion_logprobs, pack, token_logprobs
from policies.models import build_policy
from policies.spec import ModelSpec
from test_models_fixtures import pad_id, real_tokenizer, tiny_spec

SEQUENCES = [[5, 17, 900, 31, 2000, 7], [44, 1000, 3], [8, 9, 10, 11]]


def _padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(map(len, rows))
    ids = torch.full((len(rows), L), pad)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(L - len(r), L) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r), 1
    return ids, mask


def _reference(model, row: list[int]) -> torch.Tensor:
    """log p(row[t] | row[:t]) from the full logits of an unpadded forward."""
    ids = torch.tensor([row])
    logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("left", [False, True])
def test_matches_full_vocabulary_reference_with_padding(arch: str, left: bool) -> None:
    tokenizer = real_tokenizer(tiny_spec(arch).tokenizer)
    model = build_policy(tiny_spec(arch), tokenizer, seed=0)
    ids, mask = _padded(SEQUENCES, pad_id(tokenizer), left)
    target = mask.bool().clone()
    target[:, 0] = False
    if left:  # the first real token of each row has no prefix either
        for i, r in enumerate(SEQUENCES):
            target[i, ids.shape[1] - len(r)] = False
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, target)
    assert lp.shape == ids.shape
    assert torch.all(lp[~target] == 0)
    for i, r in enumerate(SEQUENCES):
        got = lp[i][target[i]]
        torch.testing.assert_close(got, _reference(model, r), atol=1e-5, rtol=0)


def test_is_differentiable_and_only_targets_carry_gradient() -> None:
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2"), tokenizer, seed=0)
    ids, mask = _padded(SEQUENCES, pad_id(tokenizer), left=False)
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[0, 3:6] = True
    lp = token_logprobs(model, ids, mask, target)
    lp.sum().backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert lp.requires_grad and torch.all(lp[0, 3:6] < 0)


def test_target_at_position_zero_is_refused() -> None:
    tokenizer = real_tokenizer("gpt2")
    model = build_policy(tiny_spec("gpt2"), tokenizer, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="no prefix"):
        token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))


def _embedded_tokens(model) -> list[int]:
    """Token positions through the input embedding, per forward (appended as forwards run)."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    return seen


def _shared_and_whole(model, pad: int) -> tuple[list[int], Packed]:
    """completion_logprobs on two groups, a prompt of its own and a reward-only row, checked against one forward
    over every whole sequence (log-probs and every parameter's gradient); returns the tokens each forward
    embedded, and the packing."""
    long, short = [5, 17, 900, 31, 2000, 7, 8, 9, 10, 11], [44, 1000, 3]
    prompts = [long] * 3 + [short] * 2 + [[8, 9]]
    completions = [[12, 13, 14], [15], [], [16, 17, 18, 19], [20, 21], [22, 23]]
    packed = pack([np.array(p) for p in prompts], [np.array(c) for c in completions], pad)
    seen = _embedded_tokens(model)
    shared = completion_logprobs(model, packed)
    shared_grads = torch.autograd.grad(shared.sum(), list(model.parameters()))
    embedded = list(seen)
    whole = token_logprobs(model, packed.input_ids, packed.attention_mask, packed.target_mask)
    whole = whole.gather(1, packed.gather_index) * packed.comp_mask
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)
    assert torch.all(shared[packed.comp_mask.bool()] < 0) and torch.all(shared[~packed.comp_mask.bool()] == 0)
    for got, want in zip(shared_grads, torch.autograd.grad(whole.sum(), list(model.parameters()))):
        torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)  # float32 sums over 262,144 terms, in another order
    return embedded, packed


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_groups_prompt_runs_once_with_the_log_probs_and_gradients_of_whole_sequences(arch: str) -> None:
    tokenizer = real_tokenizer(tiny_spec(arch).tokenizer)
    model = build_policy(tiny_spec(arch), tokenizer, seed=0).eval()
    embedded, packed = _shared_and_whole(model, pad_id(tokenizer))
    assert packed.prompt_of.tolist() == [0, 0, 0, 1, 1, 2]
    # the prompts' forward (3 distinct x 10 positions), then the completions' (6 rows x 4 tokens), not 6 x 14
    assert embedded == [3 * 10, 6 * 4]


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "phi3"])
def test_other_families_run_a_groups_prompt_once_alike(arch: str) -> None:
    """Each family's own cache (gemma2's has sliding-window layers) indexed out to a row per sample."""
    tokenizer = real_tokenizer("qwen2")
    spec = ModelSpec(name="m", arch=arch, tokenizer="qwen2", n_layer=2, n_embd=64, n_head=2)
    embedded, _ = _shared_and_whole(build_policy(spec, tokenizer, seed=0).eval(), pad_id(tokenizer))
    assert embedded == [3 * 10, 6 * 4]


@pytest.mark.parametrize("bias", [False, True])
def test_the_chunked_head_equals_the_whole_matrix_in_value_and_gradient(bias: bool) -> None:
    """Gemma 3's vocabulary: the head runs in blocks of rows and recomputes them in the backward, never holding
    the (N, V) logits, and gives the one-matrix path's log-probs and gradients (hidden states, weight, bias)."""
    from policies.chunked_head import block_rows, chunked_head_logprobs

    V, D, N = 262_144, 8, 150
    assert block_rows(V) < N  # three blocks, the last one short
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(V, generator=gen))
    hidden = torch.randn(N, D, generator=gen, requires_grad=True)
    targets = torch.randint(V, (N,), generator=gen)
    weights = torch.randn(N, generator=gen)  # a loss that weighs each row differently, as advantages do

    def grads(values: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad((values * weights).sum(), [hidden, *head.parameters()])

    whole = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    chunked = chunked_head_logprobs(head, hidden, targets)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-5)
    for got, want in zip(grads(chunked), grads(whole)):
        torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)  # float32 sums over 262,144 terms, in another order


def test_a_large_vocabulary_step_goes_through_the_chunked_head_to_the_same_log_probs() -> None:
    """token_logprobs on a model whose (N, V) logits pass one block takes the chunked path, to what the model's
    own full logits give."""
    spec = ModelSpec(name="big-vocab", arch="llama", tokenizer="", n_layer=1, n_embd=16, n_head=2, max_seq_len=64)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=262_144, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    del spec
    rows = [list(range(7 + i, 7 + i + 40)) for i in range(3)]  # 117 targets x 262,144 > one block
    ids, mask = _padded(rows, 0, left=False)
    target = mask.bool().clone()
    target[:, 0] = False
    lp = token_logprobs(model, ids, mask, target)
    lp.sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0  # tied: the head's gradient reaches it
    with torch.no_grad():
        for i, r in enumerate(rows):
            torch.testing.assert_close(lp[i][target[i]].detach(), _reference(model, r), atol=1e-4, rtol=0)


def test_a_learners_backward_adds_the_vocabulary_gradients_into_grad_in_place_to_the_same_values() -> None:
    """A tied 262,144-token embedding and head: inside grads_into_params with the embedding's gradient sparse, two
    backward passes (micro-batches) add into the one dense ``.grad`` and give what plain autograd's dense gradients
    add up to, while autograd itself carries only the looked-up rows (no (V, D) matrix passes to ``.grad``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from policies.chunked_head import dense_grads, grads_into_params, sparse_input_embedding

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=262_144, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                            tie_word_embeddings=True))

    pieces = [_padded([list(range(7 + i, 47 + i)) for i in range(3)], 0, left=False),
              _padded([list(range(900, 950)), list(range(5, 30))], 0, left=False)]

    def backward(m, ids, mask):
        target = mask.bool().clone()
        target[:, 0] = False
        token_logprobs(m, ids, mask, target).sum().backward()

    plain = model()
    for ids, mask in pieces:
        backward(plain, ids, mask)
    ours = model()
    sparse = sparse_input_embedding(ours)
    weight = ours.get_input_embeddings().weight
    assert sparse == [weight] and weight is ours.get_output_embeddings().weight
    carried = []
    weight.register_hook(lambda g: carried.append(g.layout))
    grads = []
    for ids, mask in pieces:
        dense_grads(sparse)
        grads.append(weight.grad)
        with grads_into_params():
            backward(ours, ids, mask)
        assert weight.grad.layout == torch.strided
    assert grads[0] is grads[1] is weight.grad  # added into in place, both passes
    assert carried == [torch.sparse_coo, torch.sparse_coo]  # the embedding's rows only; the head's went in place
    for (name, got), want in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=5e-4, rtol=1e-3, msg=name)
    assert weight.grad.abs().sum() > 0
