"""A role switch gives the old role's memory back before the new role takes its own.

- ``held_bytes`` counts exactly params + grads + AdamW moments and step counters, shared storages once;
- a worker in process switches roles with real tiny models and a real optimizer step: what it
  still holds after the release is only the module the new role reuses, and nothing dropped survives;
- a real pool run on CPU (gloo): one worker goes generator(gpt2) -> learner(gpt2) -> generator(llama),
  another (a non-leader rank) learner(llama) -> generator(gpt2) -> learner(llama); every switch is
  in metrics.jsonl, the rejoining rank holds rank 0's exact state, and no experience is lost.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from engine.config import tokenizer_cache
from engine.metrics import MetricsWriter
from engine.optim import adamw
from engine.poolconfig import ScriptedMove, load_pool_run
from engine.poolworker import PoolWorkerPlan, Worker
from engine.rolememory import device_bytes, held_bytes, release
from poolsetup import static_pool


class _Tied(torch.nn.Module):
    """Input and output embedding share one matrix, as in the pool's models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) * self.scale[0])


def test_held_bytes_counts_params_grads_and_adamw_state_once():
    torch.manual_seed(0)
    model = _Tied()
    opt = adamw(model.parameters(), lr=1e-2)
    params = 11 * 4 + 11  # the tied matrix once, plus the bias
    assert held_bytes(model) == 4 * params + 4 * 3  # + the buffer
    model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum().backward()
    opt.step()
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert len(opt.state) == 2 and steps == 2 * 4  # one float32 step counter per parameter tensor
    # params + grads + exp_avg + exp_avg_sq, each 4 bytes an element, + step counters + buffer
    assert held_bytes(model, opt) == 4 * (4 * params) + steps + 4 * 3
    assert held_bytes(model, opt, model, opt.state[model.emb.weight]["exp_avg"][0]) == held_bytes(model, opt)
    assert held_bytes(opt) == held_bytes(model, opt) - 4 * 3  # the optimizer reaches params and grads too
    assert device_bytes("cpu") is None
    release()
    with pytest.raises(TypeError, match="not dict"):
        held_bytes({})


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A pool worker in this process (no sockets) over two tiny real models saved as warm starts."""
    from policies.models import build_policy, save_policy
    from tokenbridge import load_tokenizer

    tmp = tmp_path_factory.mktemp("switch")
    cfg, pool = load_pool_run("configs/pool.toml")
    models = [msgspec.structs.replace(m, n_layer=1, n_embd=32, n_head=2) for m in cfg.models]
    cfg = msgspec.structs.replace(cfg, models=models)
    ckpts = []
    for spec in models:
        tok = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
        ckpts.append(str(tmp / spec.name))
        save_policy(build_policy(spec, tok), tok, ckpts[-1])
    plan = PoolWorkerPlan(worker_id="w9", index=9, run_id="t", run_dir=str(tmp), config=cfg, pool=pool,
                          broker_in="", broker_out="", plane="", warm_checkpoints=ckpts)
    w = Worker(plan)
    w.metrics = MetricsWriter(tmp, "mwra")
    yield w
    w.metrics.close()


def _records(worker: Worker) -> list[dict]:
    lines = worker.metrics.path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "role_switch"]


def _learn(worker: Worker, model: str) -> int:
    """Take the learner role as learn_role does, and take one real optimizer step; returns its tensor count."""
    from engine.poollearner import LearnerCore

    worker.learners[model] = core = LearnerCore(worker, model)
    assert core.module is worker.policy(model)[1]  # the same model's module is reused, not rebuilt
    ids = torch.tensor([[5, 6, 7, 8]])
    core.module(input_ids=ids).logits.logsumexp(-1).sum().backward()
    core.state.optimizer.step()
    worker.acquired()
    return len(core.state.params)


def test_switches_release_all_but_the_reused_module(worker):
    gpt2_bytes = held_bytes(worker.policy("gpt2")[1])
    worker._switch_to(("generator", "gpt2"))  # the first role: no switch
    worker._switch_to(("learner", "gpt2"))
    tensors = _learn(worker, "gpt2")
    worker._switch_to(("generator", "gpt2"))  # the module stays; grads and moments go
    worker.acquired()
    worker._switch_to(("learner", "gpt2"))  # a fresh learner state on the same module
    _learn(worker, "gpt2")
    worker._switch_to(("generator", "llama"))  # nothing of gpt2 is reused
    llama_bytes = held_bytes(worker.policy("llama")[1])
    worker.acquired()
    worker._switch_to(("generator", "gpt2"))  # generator -> generator of another model
    worker.policy("gpt2")
    worker.acquired()
    worker._switch_to(("idle", ""))

    records = _records(worker)
    to_learner, to_gen, again, to_llama, to_gpt2, to_idle = records
    learner_bytes = 4 * gpt2_bytes + 4 * tensors  # weights, grads, exp_avg, exp_avg_sq + float32 step counters
    assert to_learner["reused"] == ["module:gpt2"]
    assert to_learner["held_bytes_before"] == to_learner["held_bytes_after_release"] == gpt2_bytes
    assert to_learner["held_bytes_after_acquire"] == learner_bytes
    assert to_gen["reused"] == ["module:gpt2"] and to_gen["held_bytes_before"] == learner_bytes
    assert to_gen["held_bytes_after_release"] == to_gen["held_bytes_after_acquire"] == gpt2_bytes
    assert again["held_bytes_before"] == again["held_bytes_after_release"] == gpt2_bytes  # the old state is gone
    assert again["held_bytes_after_acquire"] == learner_bytes
    assert to_llama["reused"] == [] and to_llama["held_bytes_after_release"] == 0
    assert to_llama["held_bytes_before"] == learner_bytes
    assert to_llama["held_bytes_after_acquire"] == llama_bytes > 0
    assert to_gpt2["held_bytes_after_release"] == 0 and to_gpt2["held_bytes_after_acquire"] == gpt2_bytes
    assert to_idle["held_bytes_after_release"] == to_idle["held_bytes_after_acquire"] == 0
    assert [r["released_alive"] for r in records] == [0] * 6  # nothing dropped outlives the release
    assert all(r["device_bytes_before"] is None for r in records)  # CPU: the allocator view is not measured
    assert worker.learners == {} and worker._policies == {}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pool_role_switches_release_before_they_acquire(tmp_path):
    from engine.poolcli import run_pool

    cfg, pool = load_pool_run("configs/pool.toml", static_pool(5, 24, (1, 1, 1, 2)))
    # static assignment in pool-key order: w0 generates gpt2, w1 llama, w2 learns gpt2, w3 (leader) + w4 llama
    pool = msgspec.structs.replace(pool, script=[
        ScriptedMove(at_s=3, worker="w4", role="generator", model="gpt2"),  # a non-leader rank leaves
        ScriptedMove(at_s=7, worker="w0", role="learner", model="gpt2"),  # generator -> learner, same model
        ScriptedMove(at_s=12, worker="w0", role="generator", model="llama"),  # learner -> the other model
        ScriptedMove(at_s=12, worker="w1", role="generator", model="gpt2"),  # generator -> generator
        ScriptedMove(at_s=16, worker="w4", role="learner", model="llama"),  # ... and rejoins its group
    ])
    result = run_pool(cfg, pool, tmp_path, quiet=True)

    assert result.audit.logged > 0
    assert result.audit.lost == 0 and result.audit.duplicates == 0, result.audit
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    switches = {(r["worker"], r["from_role"], r["from_model"], r["to_role"], r["to_model"]): r
                for r in records if r.get("event") == "role_switch"}
    assert sorted(switches) == sorted([
        ("w4", "learner", "llama", "generator", "gpt2"), ("w0", "generator", "gpt2", "learner", "gpt2"),
        ("w0", "learner", "gpt2", "generator", "llama"), ("w1", "generator", "llama", "generator", "gpt2"),
        ("w4", "generator", "gpt2", "learner", "llama")])
    gpt2_module = switches["w4", "learner", "llama", "generator", "gpt2"]["held_bytes_after_acquire"]
    for (w, _, old, _, new), r in switches.items():
        assert r["held_bytes_before"] > 0 and r["released_alive"] == 0, r
        assert r["held_bytes_after_acquire"] > r["held_bytes_after_release"], r
        if old == new:  # only the module stays, without its gradients
            assert r["reused"] == [f"module:{old}"] and r["held_bytes_after_release"] == gpt2_module, r
        else:
            assert r["reused"] == [] and r["held_bytes_after_release"] == 0, r
    # a learner's memory (weights, moments) is several times its module's; a generator holds the module only
    to_learner = switches["w0", "generator", "gpt2", "learner", "gpt2"]
    assert to_learner["held_bytes_after_acquire"] >= 3 * gpt2_module
    assert switches["w1", "generator", "llama", "generator", "gpt2"]["held_bytes_after_acquire"] == gpt2_module

    # the rank that rejoined built a fresh learner state and holds rank 0's exact state
    llama = [f for f in result.formations if f["model"] == "llama"]
    assert [sorted(f["digests"]) for f in llama] == [["w3", "w4"], ["w3"], ["w3", "w4"]]
    assert 0 < llama[2]["step"] and llama[2]["digests"]["w4"] == llama[2]["digests"]["w3"]
    for f in result.formations:
        assert len(set(f["digests"].values())) == 1, f
    # generators that switched load the newest published weights before their first batch
    published = {(r["model"], r["weight_version"]): r["params_digest"] for r in records if r.get("event") == "step"}
    for w, m in (("w0", "llama"), ("w1", "gpt2"), ("w4", "gpt2")):
        used = [r for r in records if r.get("event") == "generator_weights" and r["worker"] == w
                and r["gen_model"] == m]
        assert used, (w, m)
        if w != "w4":  # moved at 12 s, when both learners have long published (w4 moved at 3 s)
            assert used[0]["weight_version"] > 0, (w, m)
        if used[0]["weight_version"] > 0:
            assert used[0]["params_digest"] == published[m, used[0]["weight_version"]]
