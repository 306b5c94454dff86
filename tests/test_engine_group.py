"""A learner rank is reassigned mid-run: the group shrinks and grows over gloo, state moves bit for bit.

Three real processes, a real tiny GPT-2 with the real GPT-2 tokenizer, the real objective:
  formation 1 = {A, B}: two data-parallel steps;
  B leaves (REGROUP at a step boundary), C joins: formation 2 = {A, C};
  C must hold exactly A's state (weights, AdamW moments and steps, version, RNG), then one more step
  must leave A and C with identical weights.
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engine.record.rundir import free_port
from engine.train import group as dp
from engine.train.batching import OwnSample
from engine.train.step import train_share

G, Q = 4, 4


def _state(seed: int, cache: str):
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    tok = load_tokenizer("gpt2", cache)
    spec = ModelSpec(name="tiny", arch="gpt2", tokenizer="gpt2", n_layer=1, n_embd=32, n_head=2, max_seq_len=32)
    model = build_policy(spec, tok, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return dp.TrainState(model, opt, torch.Generator().manual_seed(seed)), tok.eos_token_id


def _step_payload(step: int, version: int, vocab: int) -> bytes:
    rng = np.random.default_rng(step)
    prompts = list(range(step * Q, (step + 1) * Q))
    own = [OwnSample(prompt_ids=rng.integers(0, vocab, 5), completion_ids=rng.integers(0, vocab, 4),
                     behaviour_logprobs=np.full(4, -2.0, np.float32), reward=float(rng.integers(0, 2)),
                     verified=False, weight_version=version, prompt_id=p) for p in prompts for _ in range(G)]
    return dp.encode_step(prompts, own, [], {}, 0, False)


def _step(state, pad: int, rank: int, world: int, raw: bytes | None) -> None:
    from policies.objectives import ObjectiveConfig

    objective = msgspec.convert({"kind": "grpo"}, ObjectiveConfig)
    command, _, n = (dp.send_header(dp.STEP, 0, len(raw)) or (dp.STEP, 0, len(raw))) if rank == 0 else dp.recv_header()
    assert command == dp.STEP
    data, own, peers = dp.decode_step(dp.broadcast_bytes(raw, n))
    train_share(state, data, own, peers, rank, world, objective, pad, grad_clip=1.0, lr=1e-2)


def _worker(name: str, ep1: str, ep2: str, out_dir: str, cache: str) -> None:
    torch.set_num_threads(1)
    state, pad = _state(seed={"A": 1, "B": 2, "C": 3}[name], cache=cache)
    vocab = state.model.config.vocab_size
    out: dict = {}
    if name in ("A", "B"):
        rank = 0 if name == "A" else 1
        dp.join(ep1, rank, 2, 60)
        dp.sync_state(state, rank)
        out["formed1"] = dp.state_digest(state)
        for step in range(2):
            _step(state, pad, rank, 2, _step_payload(step, state.version, vocab) if rank == 0 else None)
            out[f"params{step}"] = dp.params_digest(state.model)
        if rank == 0:
            dp.send_header(dp.REGROUP, 2)
        else:
            assert dp.recv_header()[0] == dp.REGROUP
        dp.leave()
        out["before"] = dp.state_digest(state)
        out["version_before"] = state.version
    if name in ("A", "C"):
        rank = 0 if name == "A" else 1
        out["fresh"] = dp.state_digest(state)
        dp.join(ep2, rank, 2, 60)
        dp.sync_state(state, rank)
        out["formed2"] = dp.state_digest(state)
        out["version_after"] = state.version
        out["opt_steps"] = sorted({float(s["step"]) for s in state.optimizer.state.values()})
        _step(state, pad, rank, 2, _step_payload(2, state.version, vocab) if rank == 0 else None)
        out["params_final"] = dp.params_digest(state.model)
        dp.leave()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.timeout(300)
def test_learner_rank_leaves_and_joins_with_identical_state(tmp_path):
    ep1, ep2 = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cache = str(tmp_path / "tok")
    _state(0, cache)  # convert the tokenizer once, before three processes race for the cache
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(n, ep1, ep2, str(tmp_path), cache)) for n in "ABC"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    a, b, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ABC")
    # formation 1: B got A's state; every step left both with the same weights
    assert a["formed1"] == b["formed1"]
    assert a["params0"] == b["params0"] and a["params1"] == b["params1"]
    assert a["params0"] != a["params1"]  # the steps really changed the weights
    # formation 2: C started different, and now holds A's state bit for bit, step count included
    assert c["fresh"] != a["before"]
    assert c["formed2"] == a["before"] == a["formed2"]
    assert c["version_after"] == a["version_before"] == 2
    assert c["opt_steps"] == [2.0]  # AdamW's per-parameter step counts came along
    assert a["params_final"] == c["params_final"]


def _dies_after_forming(endpoint: str) -> None:
    dp.join(endpoint, 1, 2, 60)
    os._exit(0)  # a rank that dies without a word


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.timeout(120)
def test_a_collective_with_a_dead_rank_fails_loudly_instead_of_hanging(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=_dies_after_forming, args=(endpoint,))
    proc.start()
    dp.join(endpoint, 0, 2, timeout_s=20)
    try:
        proc.join(60)
        with pytest.raises(dp.GroupError, match="allreduce_grads failed"):
            dp.allreduce_grads([torch.nn.Parameter(torch.ones(4))])
    finally:
        dp.leave()


def test_the_rendezvous_listens_on_the_groups_address_only():
    """torch's TCPStore alone listens on every interface; the group's rank 0 serves it on 127.0.0.1 only."""
    import psutil

    port = free_port()
    dp.join(f"tcp://127.0.0.1:{port}", 0, 1, 30)
    try:
        listening = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"]
    finally:
        dp.leave()
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    assert any(addr.port == port for addr in listening)
