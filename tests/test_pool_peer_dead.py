"""A real pool run where one model falls silent: its peer presumes it dead, trains solo, says so,
and is not held back by the silent model's learner any more."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.poolcli import run_pool
from engine.poolconfig import ScriptedMove, load_pool_run
from poolsetup import static_pool


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_silent_peer_is_presumed_dead_and_its_peer_trains_solo(tmp_path):
    cfg, pool = load_pool_run("configs/pool.toml", static_pool(4, 36, (1, 1, 1, 1)) + [
        "pool.peer_dead_after_s=8", "pool.max_model_lead_batches=2", "train.peer_deadline_s=2"])
    # static assignment in pool-key order: w0 generates gpt2, w1 llama, w2 learns gpt2, w3 llama.
    # At 6 s llama loses its only generator: from then on no llama experience arrives.
    pool = msgspec.structs.replace(pool, script=[ScriptedMove(at_s=6, worker="w1", role="idle")])
    result = run_pool(cfg, pool, tmp_path, quiet=True)

    assert result.audit.lost == 0 and result.audit.duplicates == 0, result.audit
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    notes = [r for r in records if r.get("event") == "peer_status" and r["model"] == "gpt2"]
    assert notes and "peer llama" in notes[0]["note"] and "training solo" in notes[0]["note"]
    assert notes[0]["dead_peers"] == ["llama"]
    solo = [r for r in records if r.get("event") == "step" and r["model"] == "gpt2" and r["solo"]]
    assert solo and all(r["dead_peers"] == ["llama"] for r in solo)
    assert all(r["peer_wait_s"] < 1.0 for r in solo)  # no deadline waits for a dead peer
    # the silent model's learner stopped; the live one went on far past the lead limit
    assert result.steps["gpt2"] > result.steps["llama"] + pool.max_model_lead_batches + 3, result.steps
