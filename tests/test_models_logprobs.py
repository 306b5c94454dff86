"""token_logprobs: equal to the full-vocabulary reference, padding-invariant, differentiable."""

from __future__ import annotations

import pytest
import torch

from policies.logprobs import token_logprobs
from policies.models import build_policy
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
