"""Device placement (``pool.device``), checked on a CPU box.

- ``pool.device = "cuda"`` where torch sees no CUDA device is one clear config error;
- the learner's batch moves to the model's device field by field (here: to CPU, where nothing
  may change, and to the ``meta`` device, which every tensor field must reach);
- the digests that prove states bit-identical, now taken through the host, give the same
  hashes as before on CPU; the staged collectives of a one-rank gloo group change nothing;
- a worker's modules, and the weights it publishes, go where they should.
The GPU side of all this runs in ``python -m benchmarks.pool_gpu_check`` (engine/MWRA.md).
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgspec
import numpy as np
import pytest
import torch

from engine.config import ConfigError, load_run_config
from engine.roles.worker import worker_device
from engine.record.rundir import free_port
from engine.train import group as dp
from engine.train.batching import OwnSample, PeerSample, build_batch
from policies.logprobs import completion_logprobs, model_device, pack
from engine.train.optim import adamw
from policies.logprobs import token_logprobs


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a box without CUDA")
def test_cuda_without_a_cuda_device_is_one_config_error():
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/pool.toml", ["pool.device=cuda"])
    message = str(err.value)
    assert "pool.device" in message and "cuda" in message and "\n" not in message
    with pytest.raises(ConfigError, match="pool.device"):  # not a device name at all
        load_run_config("configs/pool.toml", ["pool.device=tpu"])


def test_workers_take_the_configured_device():
    cfg = load_run_config("configs/pool.toml")
    assert cfg.pool.device == "cpu" and {worker_device(cfg, i) for i in range(8)} == {torch.device("cpu")}
    if torch.cuda.is_available():
        cfg = load_run_config("configs/pool.toml", ["pool.device=cuda"])
        n = torch.cuda.device_count()
        assert [worker_device(cfg, i) for i in range(2 * n)] == [torch.device("cuda", i % n) for i in range(2 * n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A real tiny GPT-2 with the real GPT-2 tokenizer."""
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    tok = load_tokenizer("gpt2", str(tmp_path_factory.mktemp("tok")))
    spec = ModelSpec(name="tiny", arch="gpt2", tokenizer="gpt2", n_layer=1, n_embd=32, n_head=2, max_seq_len=32)
    return build_policy(spec, tok, seed=0).train(), tok.eos_token_id


def _samples(vocab: int) -> tuple[list[OwnSample], list[PeerSample]]:
    rng = np.random.default_rng(0)
    own = [OwnSample(prompt_ids=rng.integers(0, vocab, 5), completion_ids=rng.integers(0, vocab, 3 + k % 2),
                     behaviour_logprobs=np.full(3 + k % 2, -2.0, np.float32), reward=float(k % 2), verified=k % 2 == 1,
                     weight_version=0, prompt_id=k // 2) for k in range(4)]
    peers = [PeerSample(model="peer", prompt_id=k, prompt_ids=rng.integers(0, vocab, 4),
                        completion_ids=rng.integers(0, vocab, 3), behaviour_logprobs=np.full(3, -1.5, np.float32),
                        align=np.arange(3), residual=0.1, reward=1.0, verified=True, weight_version=0)
             for k in range(2)]
    return own, peers


def test_batch_to_keeps_values_and_moves_every_tensor_field(tiny):
    model, pad = tiny
    own, peers = _samples(model.config.vocab_size)
    batch = build_batch(model, own, peers, [0, 1], 1, pad, {"peer": 1})
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    tensors = {k for k, v in fields.items() if isinstance(v, torch.Tensor)}
    assert len(tensors) == 18 and fields["prox_logp"] is None and fields["ref_logp"] is None

    assert model_device(model) == torch.device("cpu")
    same = batch.to(model_device(model))  # cpu -> cpu: the very same tensors, graph included
    assert all(getattr(same, k) is fields[k] for k in tensors)
    assert same.num_groups == 2 and same.prox_logp is None and same.ref_logp is None

    moved = batch.to("meta")  # a real device of torch's: every tensor field must get there
    assert {k for k in tensors if getattr(moved, k).device.type == "meta"} == tensors
    assert all(getattr(moved, k).shape == fields[k].shape and getattr(moved, k).dtype == fields[k].dtype
               for k in tensors)
    assert moved.logp.requires_grad and moved.num_groups == 2 and moved.prox_logp is None
    assert all(v.device.type == "cpu" for k, v in fields.items() if k in tensors)  # the original is untouched
    full = dataclasses.replace(batch, prox_logp=batch.logp.detach(), ref_logp=batch.logp.detach() - 1.0,
                               peer_capability=batch.peer_rewards.clone())
    moved = full.to("meta")  # the optional fields too, when they are set: all 21
    assert sum(getattr(moved, f.name).device.type == "meta" for f in dataclasses.fields(moved)
               if f.name not in ("num_groups", "totals", "own_capability")) == 21  # totals: a function
    # (policies.denominators); own_capability: a float

    packed = pack([s.prompt_ids for s in own], [s.completion_ids for s in own], pad)
    assert all(t.device.type == "meta" for t in dataclasses.astuple(packed.to("meta")))
    # the forward on the model's device gives what the direct computation gives, bit for bit
    direct = token_logprobs(model, packed.input_ids, packed.attention_mask, packed.target_mask)
    assert torch.equal(completion_logprobs(model, packed), direct.gather(1, packed.gather_index) * packed.comp_mask)


def test_a_batch_on_two_devices_is_one_clear_error_before_any_kernel(tiny):
    """Both training paths (one rank's train_share, a sharded group's pieces) take their batch from build_batch,
    which puts every tensor on the model's device (a meta forward cannot run, so the move itself is checked on
    the GPU: benchmarks/gpu.py's sharded learner). A batch that still mixes devices is refused by name."""
    model, pad = tiny
    own, peers = _samples(model.config.vocab_size)
    batch = build_batch(model, own, peers, [0, 1], 1, pad, {"peer": 1})
    batch.validate()  # one device: fine
    mixed = dataclasses.replace(batch, logp=batch.logp.to("meta"), peer_logp=batch.peer_logp.to("meta"))
    with pytest.raises(ValueError, match=r"ObjectiveBatch\.behav_logp is on cpu, logp on meta"):
        mixed.validate()


def _old_state_digest(state: dp.TrainState) -> str:
    """state_digest as it was before device placement (CPU tensors only)."""
    h = hashlib.sha256()
    h.update(str(state.version).encode())
    for p in state.params:
        h.update(p.detach().contiguous().numpy().tobytes())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = state.optimizer.state.get(p, {}).get(key)
            if value is not None:
                h.update(value.detach().contiguous().numpy().tobytes())
    h.update(state.rng.get_state().numpy().tobytes())
    return h.hexdigest()


def _old_params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_digests_and_staged_collectives_are_unchanged_on_cpu(tiny):
    model, pad = tiny
    state = dp.TrainState(model, adamw(model.parameters(), lr=1e-2), torch.Generator().manual_seed(3))
    assert dp.state_digest(state) == _old_state_digest(state)  # before any optimizer state exists
    own, _ = _samples(model.config.vocab_size)
    build_batch(model, own, [], [0, 1], 0, pad).logp.sum().backward()
    state.optimizer.step()
    state.version = 1
    assert dp.state_digest(state) == _old_state_digest(state)
    assert dp.params_digest(model) == _old_params_digest(model)

    grads = [p.grad.clone() for p in state.params]
    before = dp.state_digest(state)
    dp.join(f"tcp://127.0.0.1:{free_port()}", 0, 1, 30)
    try:
        dp.allreduce_grads(state.params)  # one rank: the sum is its own gradient, in fresh memory
        assert all(torch.equal(p.grad, g) for p, g in zip(state.params, grads))
        assert len({p.grad.untyped_storage().data_ptr() for p in state.params}) == len(state.params)
        dp.sync_state(state, 0)  # rank 0 broadcasting to itself leaves every bit as it was
        assert dp.state_digest(state) == before
    finally:
        dp.leave()

    fresh = dp.TrainState(model, adamw(model.parameters(), lr=1e-2), torch.Generator())
    counters = dp._opt_tensors(fresh)[0::3]  # a joining rank's fresh AdamW state
    assert all(c.device == model_device(model) and c.dtype == torch.float32 for c in counters)


def test_worker_modules_and_published_weights_live_where_they_should(tmp_path):
    """A worker's module is on its device; what its learner publishes loads back exactly into another module."""
    from engine.roles.worker import Worker, WorkerPlan
    from engine.weights.channel import WeightReader, WeightWriter
    from policies.models import build_policy, save_policy
    from tokenbridge import load_tokenizer

    cfg = load_run_config("configs/pool.toml")
    spec = msgspec.structs.replace(cfg.models[0], n_layer=1, n_embd=32, n_head=2)
    cfg = msgspec.structs.replace(cfg, models=[spec, cfg.models[1]])
    tok = load_tokenizer(spec.tokenizer)
    save_policy(build_policy(spec, tok, seed=1), tok, str(tmp_path / "warm"))
    plan = WorkerPlan(worker_id="w1", device_index=1, run_id="t", run_dir=str(tmp_path), config=cfg, broker_in="",
                      broker_out="", plane="", weights_root=str(tmp_path / "weights"),
                      warm_checkpoints={spec.name: str(tmp_path / "warm")}, warm_accuracy={})
    worker = Worker(plan)
    assert worker.device == worker_device(cfg, 1)
    module = worker.policy(spec.name).module
    assert {p.device for p in module.parameters()} == {worker.device}

    writer = WeightWriter(worker.plan_channel(spec.name), module)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
    writer.publish(1)
    other = build_policy(spec, tok, seed=2).to(worker.device)
    assert dp.params_digest(other) != dp.params_digest(module)
    assert WeightReader(worker.plan_channel(spec.name), other).load() == 1
    assert dp.params_digest(other) == dp.params_digest(module)
    writer.close()


def test_an_sglang_engine_gets_the_models_dtype_and_its_share_of_the_gpu():
    """sglang.Engine's arguments (not run here: sglang needs CUDA): the model's dtype, never sglang's "auto"
    (float16 for a float32 warm start); mem_fraction_static split between the workers a GPU holds (round robin:
    worker_device); no memory saver (a role switch shuts the engine down); sglang_args over all of them."""
    from engine.roles.generator import workers_on_gpu
    from policies.sglang_backend import engine_args

    args = engine_args("bfloat16", 7, 1, 0.7 / 2, False)
    assert args == {"dtype": "bfloat16", "random_seed": 7, "base_gpu_id": 1, "mem_fraction_static": 0.35,
                    "enable_deterministic_inference": False}
    assert engine_args("bfloat16", 7, 1, 0.35, True, {"mem_fraction_static": 0.5})["mem_fraction_static"] == 0.5
    cfg = load_run_config("configs/pool.toml")  # 8 workers on one node
    gpus = max(torch.cuda.device_count(), 1)
    assert sum(workers_on_gpu(cfg, g) for g in range(min(gpus, 8))) == cfg.pool.workers_per_node() == 8
