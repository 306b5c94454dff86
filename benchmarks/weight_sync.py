"""Weight sync: learner -> generator over torch.distributed (gloo), against a plain memcpy.

Two real processes hold the default GPT-2-style policy (real GPT-2 vocabulary, so the
tied 50257 x 128 embedding dominates the bytes). One sync is timed from the learner's
``WeightSender.publish`` (snapshot) to the moment the generator's ``WeightReceiver``
has loaded the weights into its model, for both data planes: the bucketed broadcast
through gloo, and the same-host shared-memory slots the engine uses on a CPU box
(torch.distributed still carries the header and the release barrier). In the same
run, the learner times a plain ``copy_`` of the same number of bytes.
ratio = memcpy_seconds / seconds for the engine's plane (1.0 would mean a sync costs
no more than one memory copy); ``broadcast_ratio`` is the same for the broadcast.

    python -m benchmarks.weight_sync [--reps 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

from engine import weightsync
from engine.runfiles import free_port
from policies.models import ModelSpec, build_policy
from tokenbridge import load_tokenizer

SPEC = ModelSpec(name="bench", arch="gpt2", tokenizer="gpt2")


def _model():
    return build_policy(SPEC, load_tokenizer(SPEC.tokenizer), seed=0)


def _learner(endpoint: str, reps: int, out, acks, shm: bool) -> None:
    torch.set_num_threads(1)
    model = _model()
    weightsync.init_group(endpoint, 0, 2, timeout_s=120)
    sender = weightsync.WeightSender(model, shm_slots=weightsync.shm_paths(endpoint) if shm else None)
    flat = torch.cat([p.detach().reshape(-1) for p in weightsync._sync_params(model)])
    copy = torch.empty_like(flat)
    memcpy = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy.copy_(flat)
        memcpy.append(time.perf_counter() - t0)
    starts = []
    for v in range(1, reps + 1):
        acks.get(timeout=120)  # the generator is entering receive(): time the sync alone
        time.sleep(0.05)
        starts.append(time.time())
        sender.publish(v)
    acks.get(timeout=120)
    out.put(("learner", sender.nbytes, starts, memcpy))
    sender.close()
    weightsync.close_group()


def _generator(endpoint: str, reps: int, out, acks, shm: bool) -> None:
    torch.set_num_threads(1)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    weightsync.init_group(endpoint, 1, 2, timeout_s=120)
    receiver = weightsync.WeightReceiver(model, shm_slots=weightsync.shm_paths(endpoint) if shm else None)
    ends = []
    for _ in range(reps):
        acks.put("ready")
        receiver.receive()
        ends.append(time.time())
    acks.put("done")
    out.put(("generator", ends, float(next(model.parameters()).abs().sum())))
    weightsync.close_group()


def measure(reps: int, shm: bool) -> dict:
    """One learner and one generator process; median seconds per sync and per memcpy."""
    ctx = mp.get_context("spawn")
    out, acks = ctx.Queue(), ctx.Queue()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_learner, args=(endpoint, reps, out, acks, shm)),
             ctx.Process(target=_generator, args=(endpoint, reps, out, acks, shm))]
    for p in procs:
        p.start()
    results = dict((msg[0], msg[1:]) for msg in (out.get(timeout=600), out.get(timeout=600)))
    for p in procs:
        p.join(timeout=60)
    nbytes, starts, memcpy = results["learner"]
    ends, checksum = results["generator"]
    if checksum == 0.0:
        raise SystemExit("error: the generator's weights never changed")
    seconds = statistics.median(e - s for s, e in zip(starts, ends))
    memcpy_s = statistics.median(memcpy)
    plane = "shared memory" if shm else "bucketed broadcast"
    print(f"{plane}: {nbytes / 1e6:.1f} MB per sync, median {seconds * 1e3:.2f} ms over {reps} syncs "
          f"({nbytes / seconds / 1e9:.2f} GB/s); memcpy of the same bytes {memcpy_s * 1e3:.2f} ms", flush=True)
    return {"bytes": nbytes, "seconds": seconds, "memcpy_seconds": memcpy_s, "ratio": memcpy_s / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="5 repetitions")
    args = parser.parse_args(argv)
    reps = 5 if args.quick else args.reps
    bcast = measure(reps, shm=False)
    shm = measure(reps, shm=True)  # what the engine uses when learner and generators share a CPU host
    print(json.dumps({**shm, "data_plane": "shm", "broadcast_seconds": bcast["seconds"],
                      "broadcast_ratio": bcast["ratio"], "reps": reps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
