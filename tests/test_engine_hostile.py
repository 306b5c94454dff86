"""10,000 hostile frames at a live run: every one is counted, by the broker or by the learners, and the run
finishes with a clean audit.

The stranger sends, in this order: well-formed experiences of this run that no learner may
train on (a completion or prompt token id past the vocabulary, a wrong group size), then
experiences of another run id, then malformed frames (garbage bytes, truncations, fields
of the wrong type). The broker rejects the last two kinds (and cuts the sender off on the
way: what follows is dropped unread, still counted); the first kind passes the broker,
which cannot know the models' vocabularies, and each learner refuses and counts it.
"""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
import zmq

from exchange.codec import Encoder
from exchange.log import ExperienceLogReader
from exchange.protocol import Stats, pack_floats, pack_ids
from exchange.subscriber import Subscriber
from tests.enginerun import Run

STEPS, G = 8, 8  # smoke.toml: G = 8
N_ILLEGAL, N_OTHER_RUN, N_MALFORMED = 3000, 2000, 5000


def _illegal(template, i: int, vocab: dict[str, int]) -> bytes:
    """A well-formed experience of this run that no learner may accept (three ways, in turn)."""
    model = ("gpt2", "llama")[i % 2]
    exp = msgspec.structs.replace(template, model=model, experience_id=f"{model}/{i}/0/mallory")
    kind = i % 3
    if kind == 0:
        exp = msgspec.structs.replace(exp, completion_ids=pack_ids([vocab[model]]), behaviour_logprobs=pack_floats([-1.0]))
    elif kind == 1:
        exp = msgspec.structs.replace(exp, group_size=G + 1)
    else:
        exp = msgspec.structs.replace(exp, prompt_ids=pack_ids([1, vocab[model] + 7]))
    return Encoder.frame([msgspec.msgpack.encode(exp)])


def _malformed(template, rng: random.Random) -> bytes:
    """A frame the broker's decoder rejects as one error."""
    whole = Encoder.frame([msgspec.msgpack.encode(template)])
    kind = rng.randrange(3)
    if kind == 0:
        return b"\xc1" + rng.randbytes(rng.randrange(0, 64))  # 0xc1 is never msgpack
    if kind == 1:
        return whole[: rng.randrange(1, len(whole) - 1)]
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(template))
    fields[rng.randrange(2, len(fields))] = {"not": "this"}
    return Encoder.frame([msgspec.msgpack.encode(fields)])


async def _broker_rejects(endpoint: str, at_least: int, timeout: float) -> Stats:
    sub = Subscriber(endpoint, ["stats"], name="hostile-test", lossless=False)

    async def wait() -> Stats:
        while True:
            msg = await sub.recv()
            if isinstance(msg, Stats) and msg.role == "broker" and msg.rejected_total >= at_least:
                return msg
    try:
        return await asyncio.wait_for(wait(), timeout)
    finally:
        sub.close()


@pytest.mark.slow
def test_ten_thousand_hostile_frames_at_a_live_run_are_all_counted(tmp_path, engine_cache):
    run = Run(tmp_path / "run", engine_cache, f"train.steps={STEPS}")
    run.wait_steps(2, "llama", timeout=900)
    endpoints = json.loads((run.run_dir / "endpoints.json").read_text())
    template = next(e for e in ExperienceLogReader(run.run_dir / "experience_log") if e.model == "gpt2")
    vocab = {"gpt2": 50257, "llama": 32000}
    rng = random.Random(0)
    frames = [_illegal(template, i, vocab) for i in range(N_ILLEGAL)]
    other_run = msgspec.structs.replace(template, run_id="someone-elses-run")
    frames += [Encoder.frame([msgspec.msgpack.encode(msgspec.structs.replace(
        other_run, experience_id=f"gpt2/{i}/0/other"))]) for i in range(N_OTHER_RUN)]
    frames += [_malformed(template, rng) for _ in range(N_MALFORMED)]
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(endpoints["publish"])
    for frame in frames:
        stranger.send(frame)
    stats = asyncio.run(_broker_rejects(endpoints["subscribe"], N_OTHER_RUN + N_MALFORMED, timeout=300))
    stranger.close(linger=0)
    ctx.term()
    assert run.finish() == 0, run.out[-3000:]
    finals = {r["model"]: r for r in run.events("final")}
    rejected_by_learners = {m: f["rejected"] for m, f in finals.items()}
    audit = run.result()["audit"]
    print(f"{len(frames)} hostile frames: broker rejected {stats.rejected_total} (cut off: {stats.cut_off}); "
          f"learners rejected {rejected_by_learners}; audit {audit}")
    assert stats.rejected_total == N_OTHER_RUN + N_MALFORMED  # each counted once, nothing else rejected
    assert len(stats.cut_off) == 1 and "cut off after 1000 bad messages" in run.out
    assert rejected_by_learners == {"gpt2": N_ILLEGAL, "llama": N_ILLEGAL}, finals
    assert run.result()["steps"] == {"gpt2": STEPS, "llama": STEPS}
    assert audit["lost"] == 0 and audit["duplicates"] == 0 and audit["untrusted"] == N_ILLEGAL, audit
    assert run.leftover() == []
