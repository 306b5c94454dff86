"""The generator role over each generation backend a model may choose (``[models.generation]``), in real runs:
sglang against tests/sglang_standin.py (sglang's JSON API answered by a real tiny model), and the
static-cache HF backend (the GPU path) on CPU in float32. Weights reach each backend every version; the
behaviour log-probs it publishes are the learner's model's at that version; nothing is lost."""

from __future__ import annotations

import pytest
from enginerun import ROOT, Run
from poolsetup import script
from sglang_standin import StandIn
from test_models_fixtures import scored_logprobs

from engine.config import load_run_config, model_spec
from engine.train import checkpoint
from engine.train.group import params_digest
from exchange.log import ExperienceLogReader
from exchange.protocol import unpack_floats, unpack_ids
from policies.backend import HFBackend
from policies.models import build_policy, load_policy, pad_token_id
from tokenbridge import load_tokenizer

pytestmark = pytest.mark.slow
STEPS = 4


def _run(tmp_path, cache, *sets: str) -> Run:
    run = Run(tmp_path / "run", cache, f"train.steps={STEPS}", "run.checkpoint_every=1", "run.keep_checkpoints=10",
              *sets)
    assert run.finish() == 0, run.out[-3000:]
    result = run.result()
    assert result["steps"] == {"gpt2": STEPS, "llama": STEPS}
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    return run


def _behaviour_is_the_learners(run: Run, model: str, atol: float) -> set[int]:
    """Each version's first logged samples of ``model``: their behaviour log-probs are what the learner's
    checkpoint of that version computes (temperature 1). Returns the versions checked."""
    firsts = {}
    for e in ExperienceLogReader(run.run_dir / "experience_log"):
        if e.model == model and e.weight_version > 0:
            firsts.setdefault(e.weight_version, e)
    for version, e in firsts.items():
        policy = load_policy(checkpoint.model_dir(run.run_dir, model) / f"step-{version:06d}")
        want = scored_logprobs(policy, unpack_ids(e.prompt_ids).tolist(), unpack_ids(e.completion_ids).tolist())
        got = unpack_floats(e.behaviour_logprobs)
        assert abs(want.numpy() - got).max() < atol, (version, want, got)
    return set(firsts)


def test_one_run_samples_gpt2_through_an_sglang_server_and_llama_through_the_static_cache_backend(tmp_path,
                                                                                                  engine_cache):
    """Each backend is sent every version. gpt2 trains LoRA adapters: the server holds the plain model and is sent
    the merged weights; llama's hf-static backend holds a copy of its own, which each version reaches. At gpt2's
    step 2 the two generators swap models: a role switch from and to an sglang generator, each way."""
    spec = model_spec(load_run_config(ROOT / "configs/smoke.toml").model("gpt2"))
    tok = load_tokenizer(spec.tokenizer)
    server = StandIn(HFBackend(build_policy(spec, tok, seed=99), tok.eos_token_id, pad_token_id(tok)),  # not the run's
                     dtype="float32")
    with server as url:
        run = _run(tmp_path, engine_cache,
                   f"models.0.generation={{backend='sglang', sglang_url='{url}', dtype='float32'}}",
                   "models.0.lora={rank=4, alpha=8}", "models.0.lr=3e-3",
                   "models.1.generation={backend='hf-static', dtype='float32'}",
                   script(("gpt2", 2, "w0", "generator", "llama"), ("gpt2", 2, "w1", "generator", "gpt2")))
    paths = [path for path, _ in server.requests]
    pushed = [int(body["weight_version"]) for path, body in server.requests if path == "/update_weights_from_tensor"]
    assert paths[:3] == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]  # a session
    assert pushed[0] == 0  # the run's weights before any sample
    assert pushed == sorted(pushed) and pushed[-1] > 0  # each version once, between units, ...
    assert len(pushed) - len(set(pushed)) <= 1  # ... but for the new generator's first push of the version it finds
    switches = {r["worker"]: r for r in run.events("role_switch")}
    assert (switches["w0"]["from_model"], switches["w0"]["to_model"]) == ("gpt2", "llama")  # off sglang
    assert (switches["w1"]["from_model"], switches["w1"]["to_model"]) == ("llama", "gpt2")  # onto sglang
    assert all(r["released_alive"] == 0 and r["held_bytes_after_acquire"] > 0 for r in switches.values())
    rows = sum(len(body["input_ids"]) for path, body in server.requests if path == "/generate")
    gpt2 = [e for e in ExperienceLogReader(run.run_dir / "experience_log") if e.model == "gpt2"]
    assert len(gpt2) == rows  # every sample the server made was published, and nothing else for gpt2
    assert {e.weight_version for e in gpt2} <= set(pushed)
    for version in pushed[1:]:  # the server held the learner's (merged) weights of that step, bit for bit
        step_dir = checkpoint.model_dir(run.run_dir, "gpt2") / f"step-{version:06d}"
        assert server.digests[version] == params_digest(load_policy(step_dir))
    assert _behaviour_is_the_learners(run, "gpt2", atol=1e-4)
    assert _behaviour_is_the_learners(run, "llama", atol=1e-4)  # each version reached the backend's own copy
    assert run.leftover() == []
