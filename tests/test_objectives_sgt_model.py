"""SGT on a tiny real model: one gradient step raises log pi(y* | prompt) of the rescued peer success."""

from __future__ import annotations

import torch
from torch import nn

from policies.objectives import GRPOConfig, ObjectiveBatch, SGTConfig, compute_loss

V, D = 11, 16


class TinyLM(nn.Module):
    """Embedding + one causal mixing layer + output head: next-token log-probs of a sequence."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Embedding(16, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def token_logp(self, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """(N, Tc) log-probs of each completion token given prompt + earlier completion tokens."""
        seq = torch.cat([prompt, completion], dim=1)  # (N, L)
        h = self.embed(seq) + self.pos(torch.arange(seq.shape[1]))[None]
        causal = torch.tril(torch.ones(seq.shape[1], seq.shape[1])) / torch.arange(1, seq.shape[1] + 1)[:, None]
        h = torch.tanh(self.mix(causal @ h))  # running mean of the prefix
        logits = self.head(h)[:, prompt.shape[1] - 1 : -1]  # predicts completion tokens
        return logits.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)


def rescue_batch(model: TinyLM, prompt, own, peer) -> ObjectiveBatch:
    G, P = own.shape[0], peer.shape[0]
    logp = model.token_logp(prompt.expand(G, -1), own)
    peer_logp = model.token_logp(prompt.expand(P, -1), peer)
    return ObjectiveBatch(
        logp=logp, behav_logp=logp.detach(), prox_logp=None, mask=torch.ones_like(logp), rewards=torch.zeros(G),
        group=torch.zeros(G, dtype=torch.long), staleness=torch.zeros(G, dtype=torch.long),
        verified=torch.zeros(G, dtype=torch.bool), num_groups=1, peer_logp=peer_logp,
        peer_behav_logp=peer_logp.detach() - 1.0, peer_mask=torch.ones_like(peer_logp),
        peer_rewards=torch.tensor([1.0, 0.0]), peer_group=torch.zeros(P, dtype=torch.long),
        peer_verified=torch.tensor([True, False]), peer_residual=torch.zeros(P),
        peer_align=torch.arange(peer.shape[1]).expand(P, -1).clone(),
    )


def step_and_measure(cfg) -> tuple[float, float, dict]:
    model = TinyLM(seed=0)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.tensor([[1, 2, 3]])
    own = torch.randint(0, V, (4, 5), generator=gen)  # the receiver's whole group fails
    peer = torch.stack([torch.tensor([7, 8, 9, 10, 7]), torch.randint(0, V, (5,), generator=gen)])  # y* = peer[0]
    y_star = peer[:1]
    with torch.no_grad():
        before = float(model.token_logp(prompt, y_star).sum())
    loss, stats = compute_loss(rescue_batch(model, prompt, own, peer), cfg, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = float(model.token_logp(prompt, y_star).sum())
    return before, after, stats


def test_sgt_step_raises_log_prob_of_peer_success():
    before, after, stats = step_and_measure(SGTConfig())
    assert stats["rescue_set_size"] == 1.0 and stats["sgt_nll"] > 0
    assert after > before + 1e-3


def test_grpo_alone_has_no_signal_on_the_failed_group():
    before, after, stats = step_and_measure(GRPOConfig())
    assert after == before and stats["loss"] == 0.0
