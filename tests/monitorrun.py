"""A small finished run directory for the monitor's tests, written by the run's own writers.

The experience log is written by the broker's log writer, metrics.jsonl by the engine's
MetricsWriter and config.toml by the run's config writer; completions are real token ids of
the models' real tokenizers (GPT-2's and Mistral's, as in configs/smoke.toml).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from engine.config import load_run_config
from exchange.records import MetricsWriter
from engine.record.rundir import write_resolved_config
from exchange.codec import Encoder
from exchange.log import ExperienceLogWriter
from exchange.protocol import SCHEMA_VERSION, Experience, pack_floats, pack_ids
from tests.enginerun import ROOT
from tokenbridge import load_tokenizer

MODELS = {"gpt2": "gpt2", "llama": "mistral"}
T0 = 1_800_000_000.0


@functools.cache
def _tokenizer(name: str):
    return load_tokenizer(name)  # a third of a second each: once per session, not once per sample


def experience(model: str, prompt: int, sample: int, version: int, t: float, answer: str, schema=SCHEMA_VERSION):
    tok = _tokenizer(MODELS[model])
    ids = tok.encode(answer, add_special_tokens=False)
    right = answer.strip() == str(prompt + 1)
    return Experience(schema, "test-run", f"{model}/{prompt}/{sample}/w0", model, "arithmetic", prompt, sample, 4,
                      version, pack_ids(tok.encode(f"Q: {prompt} + 1\nA:", add_special_tokens=False)), pack_ids(ids),
                      pack_floats([-0.5] * len(ids)), answer, float(right), right, "stop", t - 0.1, t)


def write_run(path: Path, prompts: int = 6, steps: int = 3, schema: int = SCHEMA_VERSION) -> Path:
    """A finished two-model run: ``prompts`` prompts of 4 samples per model, ``steps`` learner steps each."""
    path.mkdir(parents=True)
    write_resolved_config(load_run_config(str(ROOT / "configs/smoke.toml")), path)
    engine = MetricsWriter(path, "engine")
    engine.write(event="allocation", t=0.0, counts={"generator:gpt2": 1, "learner:gpt2": 1},
                 workers={"w0": ["generator", "gpt2"], "w1": ["generator", "llama"], "w2": ["learner", "gpt2"],
                          "w3": ["learner", "llama"]})
    encoder = Encoder(check=schema == SCHEMA_VERSION)
    start = time.time() - prompts
    with ExperienceLogWriter(path / "experience_log") as log:
        for p in range(prompts):
            t = start + p  # now-ish, as the metrics writer stamps its records
            batch = [experience(m, p, s, p // 2, t, f" {p + 1}" if (s + (m == "gpt2")) % 2 else f" {p + 2}", schema)
                     for m in MODELS for s in range(4)]
            log.append_raw([encoder.encode(e) for e in batch])
    for model in MODELS:
        w = MetricsWriter(path, model)
        peer = "llama" if model == "gpt2" else "gpt2"
        w.write(event="start", step=0, weight_version=0, warm_accuracy=0.25)
        for k in range(1, steps + 1):
            w.write(event="step", step=k, weight_version=k, reward_mean=0.5, staleness_mean=0.5, own_experiences=8 * k,
                    peer_experiences=8 * k, peer_used=2 * k, peer_late=0, thl_residual_mean=1.0,
                    thl_residual_by_peer={peer: 1.0}, **{"obj/rescue_set_size": 1.0})
        w.write(event="final", step=steps, accuracy=0.5, own_experiences=8 * steps)
        w.close()
    engine.write(event="assign", changes={"w1": ["generator", "gpt2"]}, reason="learner:llama starved: busy 16%")
    engine.close()
    (path / "run_result.json").write_text(json.dumps({"ok": True}))
    return path
