"""Weight sync: learner -> generator through the engine's weight channel, against a plain memcpy.

Two real processes hold the default GPT-2-style policy (real GPT-2 vocabulary, so the tied
50257 x 128 embedding dominates the bytes). A sync is what the engine pays per new version:
the learner's ``WeightWriter.publish`` (pack into a shared-memory slot) plus the
generator's ``WeightReader.load`` (switch its parameters to the slot: zero copy on a CPU).
Each side times its own part (a pipe says "published"; the engine needs no message: a
generator reads the head at its next unit). In the same run the learner times a plain
``copy_`` of the same number of bytes. ratio = memcpy_seconds / sync_seconds (1.0: a sync
costs one memory copy); ``copy_ratio`` is the same with the generator copying the
weights out of the slot, as a reader on a GPU does. ``broadcast_ratio`` is the same for
``pool.weights = "broadcast"`` (``engine.weights.broadcast``: the learner packs a snapshot, the
generator asks and receives it over its pair group: gloo over loopback here, NCCL between
GPUs), reported beside the channel, with no limit of its own: on one host the channel is the path.

    python -m benchmarks.weight_sync [--reps 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.weights.broadcast import BroadcastReader, BroadcastWriter, open_board
from engine.weights.channel import WeightReader, WeightWriter, sync_params
from policies.models import ModelSpec, build_policy
from tokenbridge import load_tokenizer

SPEC = ModelSpec(name="bench", arch="gpt2", tokenizer="gpt2")
LIMIT = 0.35


def _model():
    return build_policy(SPEC, load_tokenizer(SPEC.tokenizer), seed=0)


def _learner(directory: str, board: str, reps: int, pipe, out) -> None:
    torch.set_num_threads(1)
    model = _model()
    writer = BroadcastWriter(board, "bench", model, 60, "learner") if board else WeightWriter(Path(directory), model)
    flat = torch.cat([p.detach().reshape(-1) for p in sync_params(model)])
    copy = torch.empty_like(flat)
    memcpy, publish = [], []
    for v in range(1, reps + 1):
        t0 = time.perf_counter()
        copy.copy_(flat)
        memcpy.append(time.perf_counter() - t0)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        pipe.recv()  # the generator is ready: nothing else runs while we publish
        t0 = time.perf_counter()
        writer.publish(v)
        publish.append(time.perf_counter() - t0)
        pipe.send(v)
    pipe.recv()
    out.put(("learner", writer.nbytes, publish, memcpy))
    writer.close()


def _generator(directory: str, board: str, reps: int, zero_copy: bool, pipe, out) -> None:
    torch.set_num_threads(1)
    model = _model()
    if board:
        reader = BroadcastReader(board, "bench", model, 60, "generator")
    else:
        reader = WeightReader(Path(directory), model)
        reader.zero_copy = zero_copy
    load = []
    for v in range(1, reps + 1):
        pipe.send("ready")
        assert pipe.recv() == v
        t0 = time.perf_counter()
        got = reader.load()
        load.append(time.perf_counter() - t0)
        if got != v:
            raise SystemExit(f"error: loaded version {got}, expected {v}")
    pipe.send("done")
    out.put(("generator", load, float(next(model.parameters()).detach().abs().sum())))
    reader.close()


def measure(reps: int, zero_copy: bool, broadcast: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    a, b = ctx.Pipe()
    store, board = open_board("127.0.0.1") if broadcast else (None, "")
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir="/dev/shm") as directory:
        procs = [ctx.Process(target=_learner, args=(directory, board, reps, a, out)),
                 ctx.Process(target=_generator, args=(directory, board, reps, zero_copy, b, out))]
        for p in procs:
            p.start()
        results = dict((msg[0], msg[1:]) for msg in (out.get(timeout=600), out.get(timeout=600)))
        for p in procs:
            p.join(timeout=60)
    nbytes, publish, memcpy = results["learner"]
    load, checksum = results["generator"]
    if checksum == 0.0:
        raise SystemExit("error: the generator's weights never changed")
    # the first publish creates and maps the slots (or forms the pair group): a one-time cost, left out
    seconds = statistics.median(publish_s + load_s for publish_s, load_s in zip(publish[1:], load[1:]))
    memcpy_s = statistics.median(memcpy)
    how = "broadcast (gloo pair group)" if broadcast else "zero copy" if zero_copy else "copy out of the slot"
    print(f"{how}: {nbytes / 1e6:.1f} MB per sync, median {seconds * 1e3:.2f} ms (publish "
          f"{statistics.median(publish[1:]) * 1e3:.2f} + load {statistics.median(load[1:]) * 1e3:.2f}) over "
          f"{reps} syncs; memcpy of the same bytes {memcpy_s * 1e3:.2f} ms", flush=True)
    return {"bytes": nbytes, "seconds": seconds, "memcpy_seconds": memcpy_s, "ratio": memcpy_s / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="6 repetitions")
    args = parser.parse_args(argv)
    reps = 6 if args.quick else args.reps
    zero = measure(reps, zero_copy=True)  # what a generator on a CPU does
    copy = measure(reps, zero_copy=False)  # what a generator on a GPU does (host -> its memory)
    bcast = measure(reps, zero_copy=False, broadcast=True)  # pool.weights = "broadcast"
    print(json.dumps({**zero, "channel": "shared-memory slots", "copy_seconds": copy["seconds"],
                      "copy_ratio": copy["ratio"], "broadcast_seconds": bcast["seconds"],
                      "broadcast_ratio": bcast["ratio"], "limit": LIMIT, "reps": reps}))
    return 0 if zero["ratio"] >= LIMIT else 1


if __name__ == "__main__":
    raise SystemExit(main())
