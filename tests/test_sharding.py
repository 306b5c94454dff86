"""FSDP2 learners on two gloo ranks (real processes): the same step as one rank, bit for bit.

Each rank shards a real tiny model with ``fully_shard``, trains two PRP steps on its share of
the prompts (peers on one rank's prompts only, so the ranks run different numbers of forwards
and the padding forwards are exercised), then both gather the full weights and AdamW moments.
The single-rank oracle is the same loss on the same model and batch, one rank after the other,
each micro-batch's loss over the step's denominators (counted over every micro-batch of both
ranks), its gradient computed alone and added piece by piece (as FSDP2 accumulates
without syncing), the two ranks' sums added once: FSDP2's reduce-scatter of two gradients is
that one addition (float addition of two terms is commutative), so weights and AdamW moments
must be equal bit for bit. One case is not: accumulation over micro-batches that each run two
forwards (own samples, then peers' tokens). FSDP2 adds each forward's gradient into the kept
unsharded gradient on its own, (a + b_peers) + b_own, where one process sums a micro-batch's
forwards first; three float32 terms associated differently differ in the last bits (seen:
<= 2e-7 on weights of magnitude 0.05 after two steps), so that case is held to atol 1e-6. A plain
single-rank step (one batch of every prompt, its own denominators) sums in another order: its
gradient agrees to float32 rounding, which is what the second assertion bounds, for token means
over micro-batches and ranks of unequal token counts too.
"""

from __future__ import annotations

import datetime

import msgspec
import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine.record.rundir import free_port
from engine.train import group as dp
from engine.train.batching import OwnSample, PeerSample, build_batch
from engine.train.optim import adamw
from engine.train.sharding import ShardedTwin, decoder_blocks, micro_batches, shard, sharded_step
from engine.train.step import peers_for, train_share
from gloo_ranks import leave_group, spawn_ranks

WORLD, G, Q, STEPS, LR = 2, 2, 6, 2, 1e-2
TOKENIZER = {"gpt2": "gpt2", "qwen2": "qwen2", "llama": "mistral"}


# PRP reads peer tokens (rank 0's prompts have peers: the ranks run different numbers of forwards);
# XGRPO reads peer rewards only (no peer forward anywhere); GRPO with both aggregations. Completions have 2 to 5 tokens: micro-batches and ranks hold unequal
# token counts, so a token mean is exact only over the step's denominators (engine.train.step.step_totals).
OBJECTIVES = {"prp": {"kind": "prp"}, "xgrpo": {"kind": "xgrpo"}, "grpo": {"kind": "grpo"},
              "grpo_seq": {"kind": "grpo", "aggregation": "seq_mean"}, "sgt": {"kind": "sgt"}}


def _objective(name: str):
    from policies.objectives import ObjectiveConfig

    return msgspec.convert(OBJECTIVES[name], ObjectiveConfig)


def _chosen(objective, data: dp.StepData) -> tuple[list, list]:
    """What of the step the objective reads, as the engine picks it."""
    from policies.objectives import peer_need

    return data.own, peers_for(peer_need(objective.kind), data.own, data.peers)


def _model(arch: str):
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    tok = load_tokenizer(TOKENIZER[arch])
    spec = ModelSpec(name="tiny", arch=arch, tokenizer=TOKENIZER[arch], n_layer=2, n_embd=32, n_head=2, max_seq_len=48)
    return build_policy(spec, tok, seed=1).train(), tok.eos_token_id


def _data(step: int, vocab: int, version: int, obj: str = "") -> dp.StepData:
    """For SGT, every own sample fails and each prompt has three peer successes: a rescue draws one per group."""
    rng = np.random.default_rng(step)
    prompts = list(range(step * Q, (step + 1) * Q))
    lengths = rng.integers(2, 6, Q * G)
    solved = (lambda i: False) if obj == "sgt" else (lambda i: bool(i % 2))
    own = [OwnSample(prompt_ids=rng.integers(0, vocab, 5), completion_ids=rng.integers(0, vocab, n),
                     behaviour_logprobs=np.full(n, -2.0, np.float32), reward=float(solved(i)), verified=solved(i),
                     weight_version=version, prompt_id=p)
           for (p, i), n in zip(((p, i) for p in prompts for i in range(G)), lengths)]
    rescued = prompts if obj == "sgt" else prompts[0::WORLD]  # else rank 0's prompts only
    peers = [PeerSample(model="peer", prompt_id=p, prompt_ids=rng.integers(0, vocab, 4),
                        completion_ids=rng.integers(0, vocab, n), behaviour_logprobs=np.full(n, -1.5, np.float32),
                        align=np.arange(n), residual=0.0, reward=1.0, verified=True, weight_version=version)
             for p in rescued for n in ((3, 2, 4) if obj == "sgt" else (3,))]
    return dp.StepData(prompts, own, peers, {"peer": version}, 0)


def _rank(rank: int, endpoint: str, out: str, arch: str, accum: int, checkpoint: bool, clip: float, obj: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=endpoint, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    model, pad = _model(arch)
    shard(model, checkpoint_activations=checkpoint)
    state = dp.TrainState(model, adamw(model.parameters(), lr=LR), torch.Generator().manual_seed(0))
    norms, grads = [], {}
    for step in range(STEPS):
        data, objective = _data(step, model.config.vocab_size, state.version, obj), _objective(obj)
        own, peers = _chosen(objective, data)
        norms.append(sharded_step(state, data, own, peers, rank, WORLD, objective, pad, clip, LR, accum)["grad_norm"])
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    moments = {n: [state.optimizer.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")]
               for n, p in model.named_parameters()}
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": params, "moments": moments, "grads": grads, "norms": norms, "local": local}, out)
    leave_group()


def _sharded(tmp_path, arch: str, accum: int, checkpoint: bool, clip: float, obj: str) -> dict:
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_rank, (f"tcp://127.0.0.1:{free_port()}", out, arch, accum, checkpoint, clip, obj), WORLD)
    return torch.load(out)


def _oracle(arch: str, accum: int, clip: float, obj: str) -> dict:
    """The same step on one process: each rank's share (in its micro-batches), the two sums added once."""
    torch.set_num_threads(1)
    model, pad = _model(arch)
    opt = adamw(model.parameters(), lr=LR)
    params, version, objective = list(model.parameters()), 0, _objective(obj)
    from policies.denominators import given_totals, local_counts
    from policies.objectives import compute_loss

    def rows(piece, chosen_own, chosen_peers):
        return [s for s in chosen_own if s.prompt_id in piece], [p for p in chosen_peers if p.prompt_id in piece]

    for step in range(STEPS):
        data = _data(step, model.config.vocab_size, version, obj)
        chosen_own, chosen_peers = _chosen(objective, data)
        pieces = [[p for p in micro_batches(data.prompts[r::WORLD], accum) if p] for r in range(WORLD)]
        totals = given_totals(sum(  # each site's count over every piece of every rank
            local_counts(build_batch(None, *rows(piece, chosen_own, chosen_peers), piece, version, pad,
                                     data.peer_version), objective, torch.Generator().manual_seed(0))
            for rank_pieces in pieces for piece in rank_pieces))
        total = None
        for rank_pieces in pieces:
            mine = None
            for piece in rank_pieces:
                opt.zero_grad(set_to_none=True)  # each piece's gradient alone, then added: as FSDP2 accumulates
                batch = build_batch(model, *rows(piece, chosen_own, chosen_peers), piece, version, pad,
                                    data.peer_version)
                batch.totals = totals
                loss, _ = compute_loss(batch, objective, torch.Generator().manual_seed(0))
                loss.backward()
                grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
                mine = grads if mine is None else [a + b for a, b in zip(mine, grads)]
            total = mine if total is None else [a + b for a, b in zip(total, mine)]
        for p, g in zip(params, total):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        version += 1
    return {"params": dict(model.named_parameters()),
            "moments": {n: [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")] for n, p in model.named_parameters()}}


def _single_rank_grads(arch: str, clip: float, obj: str) -> dict:
    """The engine's own data-parallel step with one rank: every prompt in one batch."""
    torch.set_num_threads(1)
    model, pad = _model(arch)
    state = dp.TrainState(model, adamw(model.parameters(), lr=LR), torch.Generator().manual_seed(0))
    data, objective = _data(0, model.config.vocab_size, 0, obj), _objective(obj)
    own, peers = _chosen(objective, data)
    train_share(state, data, own, peers, 0, 1, objective, pad, clip, LR)
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("arch, accum, checkpoint, obj, exact", [
    ("gpt2", 1, False, "grpo_seq", True),  # plain data-parallel sharding
    ("qwen2", 2, True, "grpo", True),  # a token mean over micro-batches and ranks; activation checkpointing
    ("qwen2", 1, True, "prp", True),  # peers on one rank only: padding forwards on the other
    ("llama", 1, False, "xgrpo", True),  # reward-only peers: no peer forward on either rank (hung here once)
    ("gpt2", 1, False, "sgt", True),  # one of three peer successes drawn per group: the same draw on any split
    ("qwen2", 2, False, "prp", False),  # accumulation of two-forward micro-batches: see the module doc
])
def test_two_gloo_ranks_of_fsdp2_equal_one_rank(tmp_path, arch: str, accum: int, checkpoint: bool, obj: str,
                                                exact: bool) -> None:
    clip = 1e6  # not binding: the clip factor is exactly 1 (a binding clip is the test below)
    got = _sharded(tmp_path, arch, accum, checkpoint, clip, obj)
    want = _oracle(arch, accum, clip, obj)
    full = {n: p.numel() for n, p in want["params"].items()}
    assert all(got["local"][n] < full[n] for n in full if full[n] > 1), "every parameter is split over the ranks"
    for name, p in want["params"].items():
        for a, b in zip([got["params"][name], *got["moments"][name]], [p.detach(), *want["moments"][name]]):
            if exact:
                assert torch.equal(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert all(n > 0 for n in got["norms"])
    single = _single_rank_grads(arch, clip, obj)
    for name, g in single.items():  # one batch of every prompt sums in another order: float32 rounding only
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_binding_clip_agrees_to_rounding(tmp_path) -> None:
    """The norm of sharded gradients is reduced shard by shard: its last bits, so the clip factor's, may differ."""
    got = _sharded(tmp_path, "gpt2", 1, False, 1e-6, "prp")
    want = _oracle("gpt2", 1, 1e-6, "prp")
    assert got["norms"][0] > 1e-6, "the clip must bind for this test to mean anything"
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p.detach(), rtol=0, atol=1e-6, msg=name)


def _twin_rank(rank: int, endpoint: str, out: str) -> None:
    """A learner formation's life under train.sharding = "fsdp2", beside the replicated step it replaces."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=endpoint, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    objective, clip, found = _objective("grpo_seq"), 1e6, {}

    def fresh() -> dp.TrainState:
        model, _ = _model("gpt2")
        return dp.TrainState(model, adamw(model.parameters(), lr=LR), torch.Generator().manual_seed(0))

    def replicated_step(state: dp.TrainState, step: int) -> None:
        data = _data(step, state.model.config.vocab_size, state.version)
        train_share(state, data, *_chosen(objective, data), rank, WORLD, objective, pad, clip, LR)

    (sharded, replicated), pad = (fresh(), fresh()), _model("gpt2")[1]
    for state in (sharded, replicated):  # AdamW moments exist before the twin is built
        replicated_step(state, 0)
    before = dp.state_digest(sharded)
    twin = ShardedTwin(sharded, rank == 0, torch.device("cpu"), (0.9, 0.999), 1, False)
    found["own_numel_inside"] = sum(p.numel() for p, _ in twin.pairs)
    found["twin_numel"] = sum(q.to_local().numel() for _, q in twin.pairs)
    twin.close()
    found["round_trip"] = rank != 0 or dp.state_digest(sharded) == before  # the leader's state is whole again
    found["follower_keeps_no_moments"] = rank == 0 or not sharded.optimizer.state
    dp.sync_state(sharded, rank)  # ... and the next formation hands it to every rank
    found["round_trip_synced"] = dp.state_digest(sharded) == before
    twin = ShardedTwin(sharded, rank == 0, torch.device("cpu"), (0.9, 0.999), 1, False)
    data = _data(1, sharded.model.config.vocab_size, sharded.version)
    twin.step(data, *_chosen(objective, data), rank, WORLD, objective, pad, clip, LR)
    replicated_step(replicated, 1)
    found["leader_weights_after_step"] = rank != 0 or dp.params_digest(sharded.model) == dp.params_digest(
        replicated.model)
    twin.gather_moments()
    found["leader_moments_for_a_checkpoint"] = rank != 0 or dp.state_digest(sharded) == dp.state_digest(replicated)
    twin.drop_moments()
    twin.close()
    dp.sync_state(sharded, rank)
    found["after_close"] = dp.state_digest(sharded) == dp.state_digest(replicated)
    found["full_numel"] = sum(p.numel() for p in replicated.params)
    torch.save(found, f"{out}.{rank}")
    leave_group()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_sharded_formation_holds_and_gives_back_the_replicated_state_bit_for_bit(tmp_path) -> None:
    """What the learner role does with train.sharding = "fsdp2": the replicated state is cut into shards (a
    follower keeps nothing whole), a step on them equals the replicated group's step bit for bit (weights the
    leader publishes, moments it checkpoints), and closing the formation gives the leader the whole state back,
    which the next formation's sync_state hands to every rank."""
    out = str(tmp_path / "twin")
    spawn_ranks(_twin_rank, (f"tcp://127.0.0.1:{free_port()}", out), WORLD)
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for rank, found in enumerate(ranks):
        assert found["round_trip"] and found["round_trip_synced"] and found["after_close"], (rank, found)
        assert found["follower_keeps_no_moments"], (rank, found)
        assert found["leader_weights_after_step"] and found["leader_moments_for_a_checkpoint"], (rank, found)
        assert found["twin_numel"] <= found["full_numel"] // WORLD + 64, (rank, found)  # 1/world, up to padding
    assert ranks[0]["own_numel_inside"] == ranks[0]["full_numel"]  # the leader keeps whole weights ...
    assert ranks[1]["own_numel_inside"] == 0  # ... a follower only its shards


def _bf16_rank(rank: int, endpoint: str, out: str) -> None:
    """One step of a formation computing in bf16 (train.mixed_precision = "bf16") beside the fp32 replicated step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=endpoint, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    objective, (model, pad) = _objective("grpo_seq"), _model("gpt2")
    states = [dp.TrainState(m, adamw(m.parameters(), lr=LR), torch.Generator().manual_seed(0))
              for m in (model, _model("gpt2")[0])]
    before = torch.cat([p.detach().reshape(-1).clone() for p in states[0].params])
    data = _data(0, model.config.vocab_size, 0)
    twin = ShardedTwin(states[0], rank == 0, torch.device("cpu"), (0.9, 0.999), 1, False, bf16=True)
    twin.step(data, *_chosen(objective, data), rank, WORLD, objective, pad, 1e6, LR)
    twin.close()
    train_share(states[1], data, *_chosen(objective, data), rank, WORLD, objective, pad, 1e6, LR)
    if rank == 0:
        bf16, fp32 = (torch.cat([p.detach().reshape(-1) for p in s.params]) for s in states)
        torch.save({"dtypes": {str(p.dtype) for p in states[0].params}, "bf16": bf16 - before, "fp32": fp32 - before},
                   out)
    leave_group()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_bf16_formation_keeps_fp32_master_weights_and_steps_like_fp32(tmp_path) -> None:
    """train.mixed_precision = "bf16": forward and backward in bfloat16, master weights, reduction and AdamW in
    fp32. The step is not fp32's bit for bit (bf16 was used) but points the same way."""
    out = str(tmp_path / "bf16")
    spawn_ranks(_bf16_rank, (f"tcp://127.0.0.1:{free_port()}", out), WORLD)
    found = torch.load(out)
    assert found["dtypes"] == {"torch.float32"}
    bf16, fp32 = found["bf16"], found["fp32"]
    assert bf16.abs().max() > 0 and not torch.equal(bf16, fp32)
    assert torch.nn.functional.cosine_similarity(bf16, fp32, dim=0) > 0.9, "the bf16 step went elsewhere"


def test_blocks_and_micro_batches() -> None:
    model, _ = _model("qwen2")
    assert [type(b).__name__ for b in decoder_blocks(model)] == ["Qwen2DecoderLayer"] * 2
    assert micro_batches([1, 2, 3], 2) == [[1, 2], [3]] and micro_batches([1], 2) == [[1], []]
    with pytest.raises(ValueError, match="names no decoder block"):
        decoder_blocks(torch.nn.Linear(2, 2))
