"""A role switch gives the old role's memory back before the new role takes its own.

- ``held_bytes`` counts exactly params + grads + AdamW moments and step counters, shared storages once;
- a worker in process switches roles with real tiny models and a real optimizer step: what it
  still holds after the release is only the module the new role reuses, and nothing dropped survives;
  the process's resident memory drops with what it dropped (the C heap's free pages go back to the OS);
The real run with switches is in tests/test_engine_pool.py.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from engine.config import load_run_config, tokenizer_cache
from engine.roles.memory import device_bytes, held_bytes, release
from engine.roles.worker import Worker, WorkerPlan
from exchange.records import MetricsWriter
from engine.train.optim import adamw


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
    cfg = load_run_config("configs/pool.toml")
    models = [msgspec.structs.replace(m, n_layer=1, n_embd=32, n_head=2) for m in cfg.models]
    cfg = msgspec.structs.replace(cfg, models=models)
    ckpts = {}
    for spec in models:
        tok = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
        ckpts[spec.name] = str(tmp / spec.name)
        save_policy(build_policy(spec, tok), tok, ckpts[spec.name])
    plan = WorkerPlan(worker_id="w9", device_index=9, run_id="t", run_dir=str(tmp), config=cfg, broker_in="",
                      broker_out="", plane="", weights_root=str(tmp / "weights"), warm_checkpoints=ckpts,
                      warm_accuracy={})
    w = Worker(plan)
    w.metrics = MetricsWriter(tmp, "engine")
    yield w
    w.metrics.close()


def _records(worker: Worker) -> list[dict]:
    lines = worker.metrics.path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "role_switch"]


def _learn(worker: Worker, model: str) -> int:
    """Take the learner role as learn_role does, and take one real optimizer step; returns its tensor count."""
    from engine.roles.learner_core import LearnerCore

    worker.learners[model] = core = LearnerCore(worker, model)
    assert core.module is worker.policy(model).module  # the same model's module is reused, not rebuilt
    ids = torch.tensor([[5, 6, 7, 8]])
    core.module(input_ids=ids).logits.logsumexp(-1).sum().backward()
    core.state.optimizer.step()
    worker.acquired()
    return len(core.state.params)


def test_switches_release_all_but_the_reused_module(worker):
    gpt2_bytes = held_bytes(worker.policy("gpt2").module)
    worker._switch_to(("generator", "gpt2"))  # the first role: no switch
    worker._switch_to(("learner", "gpt2"))
    tensors = _learn(worker, "gpt2")
    worker._switch_to(("generator", "gpt2"))  # the module stays; grads and moments go
    worker.acquired()
    worker._switch_to(("learner", "gpt2"))  # a fresh learner state on the same module
    _learn(worker, "gpt2")
    worker._switch_to(("generator", "llama"))  # nothing of gpt2 is reused
    llama_bytes = held_bytes(worker.policy("llama").module)
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
    for r in (to_gen, to_llama):  # the machine gets the learner state back: the C heap's free pages are trimmed
        freed = r["held_bytes_before"] - r["held_bytes_after_release"]
        assert r["rss_before"] - r["rss_after_release"] >= freed // 2, (r, freed)
    assert worker.learners == {} and worker.policies == {}
