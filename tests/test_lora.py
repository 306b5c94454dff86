"""LoRA through peft: adapters on a frozen base, trained alone, sent alone, saved merged and resumable."""

from __future__ import annotations

import pytest
import torch

from engine.train.group import params_digest
from engine.train.optim import adamw
from engine.weights.channel import WeightReader, WeightWriter
from policies.lora import ADAPTER_FILE, LoraSpec, adapter_bytes, adapter_state, add_adapters, load_adapters, merged
from policies.models import ModelSpec, build_policy, load_policy, save_policy
from tokenbridge import load_tokenizer

FAMILY_TOKENIZER = {"gpt2": "gpt2", "llama": "mistral", "qwen2": "qwen2"}
SPEC = LoraSpec(rank=4, alpha=8.0)


def _model(arch: str, lora: LoraSpec | None = SPEC, seed: int = 7):
    tok = load_tokenizer(FAMILY_TOKENIZER[arch])
    model = build_policy(ModelSpec(name=arch, arch=arch, tokenizer=FAMILY_TOKENIZER[arch], n_layer=2, n_embd=64,
                                   n_head=2), tok)
    return add_adapters(model, lora, seed) if lora else model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))


def _train_step(model) -> None:
    """One AdamW step on the trainable parameters, as the learner builds its optimizer."""
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(_tokens()).logits.logsumexp(-1).mean().backward()
    optimizer.step()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_adapters_start_as_the_base_and_only_they_train(arch):
    base, adapted = _model(arch, lora=None), _model(arch)
    with torch.no_grad():
        assert torch.equal(adapted(_tokens()).logits, base(_tokens()).logits)  # B starts at zero
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    frozen = {n: p.clone() for n, p in adapted.named_parameters() if not p.requires_grad}
    _train_step(adapted)
    assert all(torch.equal(p, frozen[n]) for n, p in adapted.named_parameters() if n in frozen)
    assert any(p.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        assert not torch.equal(adapted(_tokens()).logits, base(_tokens()).logits)


def test_every_process_draws_the_same_adapters_and_the_global_rng_is_untouched():
    rng = torch.get_rng_state()
    first, second = _model("llama"), _model("llama")
    assert torch.equal(torch.get_rng_state(), rng)
    assert params_digest(first) == params_digest(second)
    assert params_digest(_model("llama", seed=8)) != params_digest(first)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_merged_copy_is_a_plain_model_computing_the_adapted_policy(arch, tmp_path):
    adapted = _model(arch)
    _train_step(adapted)
    plain = merged(adapted)
    assert type(plain) is type(adapted)
    assert set(plain.state_dict()) == set(_model(arch, lora=None).state_dict())
    with torch.no_grad():
        want = adapted(_tokens()).logits
        assert torch.allclose(plain(_tokens()).logits, want, atol=1e-5)
    assert any(".lora_" in n for n, _ in adapted.named_parameters())  # the live model keeps its adapters
    save_policy(plain, load_tokenizer(FAMILY_TOKENIZER[arch]), tmp_path / "ckpt")
    with torch.no_grad():  # any tool loads the trained policy from the checkpoint
        assert torch.allclose(load_policy(tmp_path / "ckpt")(_tokens()).logits, want, atol=1e-5)


def test_adapters_round_trip_through_their_file_and_a_mismatch_is_named(tmp_path):
    trained = _model("qwen2")
    _train_step(trained)
    (tmp_path / ADAPTER_FILE).write_bytes(adapter_bytes(trained))
    fresh = _model("qwen2")
    load_adapters(fresh, tmp_path)
    assert params_digest(fresh) == params_digest(trained)
    other = _model("qwen2", lora=LoraSpec(rank=4, targets=["q_proj", "k_proj", "v_proj"]))
    with pytest.raises(ValueError, match=f"{ADAPTER_FILE}: its adapters do not match the model's lora settings"):
        load_adapters(other, tmp_path)


def test_a_target_the_model_lacks_is_one_error_naming_lora():
    with pytest.raises(ValueError, match="^lora: .*no_such_proj"):
        _model("llama", lora=LoraSpec(targets=["no_such_proj"]))


def test_the_weight_channel_carries_the_adapters_alone(tmp_path):
    learner, generator = _model("gpt2"), _model("gpt2")
    _train_step(learner)
    writer = WeightWriter(tmp_path / "gpt2", learner)
    reader = WeightReader(tmp_path / "gpt2", generator)
    assert writer.nbytes == sum(t.numel() * 4 for t in adapter_state(learner).values())
    assert writer.nbytes < sum(p.numel() * 4 for p in learner.parameters()) / 100
    writer.publish(1)
    assert reader.load() == 1
    assert params_digest(generator) == params_digest(learner)  # the frozen base is the same everywhere
    reader.close(detach=True)
    writer.close()


@pytest.mark.slow
def test_a_run_trains_gpt2_through_adapters_beside_a_full_llama_and_resumes(tmp_path, engine_cache):
    """The smoke run with LoRA on gpt2 only: generators run the learner's exact weights while only the
    adapters travel; the checkpoint is the merged policy over the untouched warm start; a resume puts
    the saved adapters back (the generators then hold the first session's step digest again)."""
    from safetensors.torch import load_file

    from engine.config import load_run_config
    from engine.roles.worker import start_module
    from engine.train import checkpoint
    from enginerun import Run

    run = Run(tmp_path / "run", engine_cache, "train.steps=6", "run.checkpoint_every=2",
              "models.0.lora={rank=4, alpha=8}")
    assert run.finish() == 0, run.out[-3000:]
    result = run.result()
    assert result["steps"] == {"gpt2": 6, "llama": 6}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]

    step_dir = checkpoint.latest(run.run_dir, "gpt2")
    adapters = load_file(step_dir / ADAPTER_FILE)
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if "lora_B" in n)  # the adapters trained
    assert not (checkpoint.latest(run.run_dir, "llama") / ADAPTER_FILE).exists()
    final = run.run_dir / "final"  # the newest checkpoint's models, for from_pretrained (and PEFT: its files)
    assert sorted(p.name for p in final.iterdir()) == ["gpt2", "llama"]
    assert {"model.safetensors", "config.json"} <= {p.name for p in (final / "gpt2").iterdir()}
    assert sorted(p.name for p in (final / "gpt2" / "adapter").iterdir()) == ["adapter_config.json",
                                                                             "adapter_model.safetensors"]
    assert not {ADAPTER_FILE, "trainer.pt", "state.json"} & {p.name for p in (final / "gpt2").iterdir()}
    sync = {r["model"]: r["weight_sync_bytes"] for r in run.events("start")}
    assert sync["gpt2"] == sum(t.numel() * 4 for t in adapters.values()) < sync["llama"] / 50

    warm = load_policy(run.events("final", "gpt2")[0]["warm_checkpoint"]).state_dict()
    trained = load_policy(step_dir).state_dict()  # any tool loads the merged policy
    assert set(trained) == set(warm)
    changed = {n for n in warm if not torch.equal(trained[n], warm[n])}
    assert changed and all(".c_attn." in n for n in changed)  # the base moved only where adapters sit

    cfg = load_run_config(run.run_dir / "config.toml")  # what the run trained with
    restored = {m: start_module(cfg, cfg.model(m), load_tokenizer(cfg.model(m).tokenizer),
                                run.events("final", m)[0]["warm_checkpoint"], str(checkpoint.latest(run.run_dir, m)))
                for m in cfg.names}  # as a resumed run's workers build them
    assert adapter_state(restored["gpt2"]).keys() == adapters.keys()
    assert all(torch.equal(t, adapters[n]) for n, t in adapter_state(restored["gpt2"]).items())
    saved = {m: params_digest(module) for m, module in restored.items()}
    longer = Run(run.run_dir, None, "train.steps=8")
    assert longer.finish() == 0, longer.out[-3000:]
    assert longer.result()["steps"] == {"gpt2": 8, "llama": 8}
    resumed = [(r["gen_model"], r["params_digest"]) for r in longer.records()
               if r.get("event") == "generator_weights" and r["weight_version"] == 6]
    assert {m for m, _ in resumed} == {"gpt2", "llama"}
    assert all(digest == saved[m] for m, digest in resumed)  # the saved adapters are back, bit for bit


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_peft_loads_the_adapters_a_checkpoint_writes_for_it_onto_the_base(arch, tmp_path):
    """A LoRA checkpoint's adapter_config.json and adapter_model.safetensors (``peft_files``): PEFT's own
    ``PeftModel.from_pretrained`` over the untouched base computes the adapted policy."""
    from peft import PeftModel

    from engine.train.checkpoint import RESUME_ONLY
    from policies.lora import PEFT_FILES, peft_files

    adapted = _model(arch)
    _train_step(adapted)
    base_dir = tmp_path / "base"
    save_policy(_model(arch, lora=None), load_tokenizer(FAMILY_TOKENIZER[arch]), base_dir)  # the warm start
    for name, data in peft_files(adapted, str(base_dir)).items():
        (tmp_path / "adapter" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "adapter" / name).write_bytes(data)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted(PEFT_FILES)
    loaded = PeftModel.from_pretrained(load_policy(base_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        want = adapted(_tokens()).logits
        assert not torch.allclose(load_policy(base_dir)(_tokens()).logits, want, atol=1e-4)  # the adapters count
        assert torch.allclose(loaded(_tokens()).logits, want, atol=1e-5)
    assert ADAPTER_FILE in RESUME_ONLY  # the final/ directory leaves out what only a resume reads
