"""Weight sync over real torch.distributed (gloo) between real processes."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine import weightsync
from engine.runfiles import free_port


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    model[1].weight = model[0].weight  # tied, like the LMs: sent once
    return model


def _learner(endpoint: str, world: int, versions: int, out, shm: bool) -> None:
    weightsync.init_group(endpoint, 0, world, timeout_s=30)
    model = _model(0)
    slots = weightsync.shm_paths(endpoint) if shm else None
    sender = weightsync.WeightSender(model, bucket_bytes=256, shm_slots=slots)  # small buckets: several per sync
    for v in range(1, versions + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        sender.publish(v)
        out.put(("sent", v, [p.detach().clone() for p in model.parameters()]))
        time.sleep(0.3)
    time.sleep(1.0)
    sender.close()
    weightsync.close_group()


def _generator(endpoint: str, rank: int, world: int, versions: int, out, shm: bool) -> None:
    weightsync.init_group(endpoint, rank, world, timeout_s=30)
    model = _model(1)  # different init: only a sync can make it equal
    slots = weightsync.shm_paths(endpoint) if shm else None
    receiver = weightsync.WeightReceiver(model, bucket_bytes=256, shm_slots=slots)
    while receiver.version < versions:
        receiver.receive()
        out.put(("got", receiver.version, [p.detach().clone() for p in model.parameters()]))
    weightsync.close_group()


@pytest.mark.parametrize("shm", [False, True], ids=["broadcast", "shared-memory"])
def test_generators_receive_exact_weights_and_versions_only_grow(shm):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_learner, args=(endpoint, 3, 3, out, shm))]
    procs += [ctx.Process(target=_generator, args=(endpoint, r, 3, 3, out, shm)) for r in (1, 2)]
    for p in procs:
        p.start()
    sent, got = {}, []
    deadline = time.time() + 60
    while (len(sent) < 3 or len([g for g in got if g[0] == 3]) < 2) and time.time() < deadline:
        kind, version, params = out.get(timeout=60)
        (sent.__setitem__(version, params) if kind == "sent" else got.append((version, params)))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(got) >= 2
    for version, params in got:
        assert version in sent
        for a, b in zip(params, sent[version]):
            assert torch.equal(a, b)  # bit for bit
    assert not any(os.path.exists(p) for p in weightsync.shm_paths(endpoint))  # the learner removed its slots


def _lonely_generator(endpoint: str, out) -> None:
    try:
        weightsync.init_group(endpoint, 1, 2, timeout_s=2)
        out.put("joined")
    except weightsync.WeightSyncError as exc:
        out.put(str(exc))


def test_missing_learner_fails_loudly_instead_of_hanging():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = ctx.Process(target=_lonely_generator, args=(endpoint, out))
    start = time.time()
    proc.start()
    message = out.get(timeout=60)
    proc.join(timeout=30)
    assert "could not form the weight-sync group" in message
    assert time.time() - start < 45
