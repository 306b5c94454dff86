"""A real pool run on CPU with gloo: a generator becomes a learner rank of one model mid-run, then
leaves that group to generate for the other model. Nothing may be lost and every hand-over is exact."""

from __future__ import annotations

import collections
import json

import msgspec
import pytest

from engine.poolcli import run_pool
from engine.poolconfig import ScriptedMove, load_pool_run
from exchange.log import ExperienceLogReader
from poolsetup import static_pool


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generator_and_learner_rank_reassigned_mid_run(tmp_path):
    cfg, pool = load_pool_run("configs/pool.toml", static_pool(5, 30, (2, 1, 1, 1)))
    # static assignment goes in pool-key order: w0,w1 generate gpt2, w2 llama, w3 learns gpt2, w4 llama
    pool = msgspec.structs.replace(pool, script=[
        ScriptedMove(at_s=5, worker="w1", role="learner", model="gpt2"),  # generator -> learner rank
        ScriptedMove(at_s=15, worker="w1", role="generator", model="llama"),  # learner rank -> other model
    ])
    result = run_pool(cfg, pool, tmp_path, quiet=True)

    assert result.audit.logged > 0
    assert result.audit.lost == 0 and result.audit.duplicates == 0, result.audit
    assert result.decisions == 2 and result.regroups == 2
    # a step's batch goes out in one-prompt work units: both gpt2 generators share batches,
    # and each prompt's G samples come from one generator
    Q = cfg.train.prompts_per_step
    by_batch, by_prompt = collections.defaultdict(set), collections.defaultdict(set)
    for exp in ExperienceLogReader(tmp_path / "experience_log"):
        maker = exp.experience_id.rsplit("/", 1)[1]
        by_prompt[(exp.model, exp.prompt_id)].add(maker)
        if exp.model == "gpt2":
            by_batch[exp.prompt_id // Q].add(maker)
    assert pool.prompts_per_work == 1 and any(len(m) > 1 for m in by_batch.values())
    assert all(len(m) == 1 for m in by_prompt.values())
    gpt2 = [f for f in result.formations if f["model"] == "gpt2"]
    assert [f["epoch"] for f in gpt2] == [1, 2, 3]
    assert sorted(gpt2[1]["digests"]) == ["w1", "w3"]  # the joiner formed with the leader ...
    for f in result.formations:  # ... and every rank of every formation holds rank 0's exact state
        assert len(set(f["digests"].values())) == 1, f
    assert 0 < gpt2[1]["step"] < gpt2[2]["step"] < result.steps["gpt2"]  # the step count carried on

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assigns = [r for r in records if r.get("event") == "assign"]
    assert [r["changes"] for r in assigns] == [{"w1": ["learner", "gpt2"]}, {"w1": ["generator", "llama"]}]
    assert all(r["reason"].startswith("scripted move") for r in assigns)
    # the generator that moved to llama runs the learner's published weights, bit for bit
    published = {r["weight_version"]: r["params_digest"] for r in records
                 if r.get("model") == "llama" and r.get("event") == "step"}
    used = [r for r in records if r.get("event") == "generator_weights" and r["worker"] == "w1"
            and r["gen_model"] == "llama"]
    assert used and used[0]["weight_version"] > 0
    assert used[0]["params_digest"] == published[used[0]["weight_version"]]
