"""Weights over a torch.distributed group (gloo here, NCCL on GPUs): bucketed, bit for bit, bounded by a time-out.

Two real processes: rank 0 is the learner (fp32), rank 1 a generator holding its own bf16 copy.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from engine.record.rundir import free_port
from gloo_ranks import spawn_ranks
from engine.weights.collective import WeightSyncError, manifest, plan, receive, send

BUCKET = 64 << 10  # small, so a tiny model takes many buckets


def _model(seed: int, n_embd: int = 64):
    from policies.models import ModelSpec, build_policy
    from tokenbridge import load_tokenizer

    spec = ModelSpec(name="q", arch="qwen2", tokenizer="qwen2", n_layer=2, n_embd=n_embd, n_head=2)
    return build_policy(spec, load_tokenizer("qwen2"), seed=seed)


def _rank(rank: int, endpoint: str, out: str, receiver_width: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=endpoint, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    result: dict = {}
    try:
        if rank == 0:
            model = _model(seed=1)
            for version in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.01)
                result[f"sent{version}"] = send(list(model.named_parameters()), version, 0, torch.bfloat16,
                                                bucket_bytes=BUCKET)
                result[f"want{version}"] = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        else:
            model = _model(seed=2, n_embd=receiver_width).to(torch.bfloat16)
            for version in (1, 2):
                result[f"version{version}"] = receive(list(model.named_parameters()), 0, torch.bfloat16,
                                                      bucket_bytes=BUCKET)
                result[f"got{version}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    except WeightSyncError as exc:
        result["error"] = str(exc)
    torch.save(result, f"{out}.{rank}")
    # Leave without interpreter teardown, as every actor does (engine/runtime/actors.py): after a failed
    # collective, gloo's destructors may find a thread still joinable and abort the process (SIGABRT).
    os._exit(0)


def _run(tmp_path, receiver_width: int, timeout_s: float) -> tuple[dict, dict]:
    out = str(tmp_path / "result")
    spawn_ranks(_rank, (f"tcp://127.0.0.1:{free_port()}", out, receiver_width, timeout_s), 2)
    return torch.load(f"{out}.0"), torch.load(f"{out}.1")


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_generator_receives_the_learners_weights_bit_for_bit_in_its_dtype(tmp_path) -> None:
    learner, generator = _run(tmp_path, receiver_width=64, timeout_s=60)
    assert "error" not in learner and "error" not in generator
    for version in (1, 2):
        assert generator[f"version{version}"] == version
        want, got = learner[f"want{version}"], generator[f"got{version}"]
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
    assert learner["sent1"] == 2 * sum(t.numel() for t in learner["want1"].values())  # bf16 on the wire


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_receiver_of_another_model_fails_at_once_and_the_sender_within_the_time_out(tmp_path) -> None:
    learner, generator = _run(tmp_path, receiver_width=32, timeout_s=5)
    assert "not the same model, dtype or bucket size" in generator["error"]
    assert "weight sync (send) failed" in learner["error"]  # its next broadcast found nobody


def test_buckets_respect_the_limit_and_name_what_sglang_needs() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(30)), ("c", torch.zeros(100)), ("d", torch.zeros(5))]
    buckets = plan(named, torch.bfloat16, bucket_bytes=80)  # 40 elements of 2 bytes
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert manifest(buckets[0], torch.bfloat16) == {"names": ["a", "b"], "dtypes": ["bfloat16"] * 2,
                                                     "shapes": [[10], [30]]}
