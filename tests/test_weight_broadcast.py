"""Weights over torch.distributed pair groups (``pool.weights = "broadcast"``): gloo here, NCCL on GPUs.

Real processes: the test hosts the board, as the coordinator does; leaders and generators are
spawned processes driven by commands, each answer awaited (a missing one fails the test).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import time

import msgspec
import pytest
import torch

from engine.config.schema import RunConfig
from engine.weights.broadcast import LOST_TICKET_S, BroadcastReader, BroadcastWriter, open_board
from engine.weights.places import broadcasts

ANSWER_S = 60.0


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def _leader(board: str, name: str, inbox, outbox) -> None:
    torch.set_num_threads(1)
    module = _module(0)
    writer = BroadcastWriter(board, "m", module, timeout_s=20, me=name)
    while True:
        cmd, arg = inbox.get()
        if cmd == "publish":  # new weights (seeded by the version), as an optimizer step would leave them
            module.load_state_dict(_module(arg).state_dict())
            writer.publish(arg)
            outbox.put(digest(module))
        elif cmd == "served":
            outbox.put((writer.served, len(writer.pairs)))
        elif cmd == "serving":
            outbox.put(writer._thread is not None and writer._thread.is_alive())
        elif cmd == "close":
            writer.close()
            outbox.put("closed")
        elif cmd == "exit":
            os._exit(0)


def _generator(board: str, name: str, inbox, outbox) -> None:
    torch.set_num_threads(1)
    module = _module(1000)
    reader = BroadcastReader(board, "m", module, timeout_s=2 * ANSWER_S, me=name)  # a wait would fail the test
    while True:
        cmd, _ = inbox.get()
        if cmd == "load":
            outbox.put((reader.load(), digest(module)))
        elif cmd == "exit":
            os._exit(0)


class Proc:
    def __init__(self, target, board: str, name: str):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=target, args=(board, name, self.inbox, self.outbox), daemon=True)
        self.process.start()

    def ask(self, cmd: str, arg=None):
        self.inbox.put((cmd, arg))
        try:
            return self.outbox.get(timeout=ANSWER_S)
        except queue.Empty:
            pytest.fail(f"no answer to {cmd!r} within {ANSWER_S:g} s")

    def stop(self) -> None:
        self.process.kill()
        self.process.join()


def served(leader: Proc, want: tuple[int, int]) -> tuple[int, int]:
    """The leader's (served, pairs) once it reads ``want``, else its last reading after ANSWER_S: a generator's
    load returns when the weights arrived, and the leader's serving thread counts the send a moment later."""
    deadline = time.time() + ANSWER_S
    while (got := leader.ask("served")) != want and time.time() < deadline:
        time.sleep(0.05)
    return got


@pytest.fixture
def board():
    store, address = open_board("127.0.0.1")
    procs: list[Proc] = []

    def start(target, name: str) -> Proc:
        procs.append(Proc(target, address, name))
        return procs[-1]

    yield store, start
    for p in procs:
        p.stop()


def test_generators_take_each_version_bit_for_bit_over_one_pair_group_each(board) -> None:
    _, start = board
    leader, gens = start(_leader, "w0"), [start(_generator, f"w{i}") for i in (1, 2)]
    assert [g.ask("load") for g in gens] == [(0, digest(_module(1000)))] * 2  # nothing published: warm start kept
    for version in (1, 2, 3):
        want = leader.ask("publish", version)
        assert [g.ask("load") for g in gens] == [(version, want)] * 2
    assert gens[0].ask("load") == (3, want)  # nothing newer: nothing asked
    assert served(leader, (6, 2)) == (6, 2)  # one pair group per generator, kept across versions


def test_a_new_leader_takes_over_and_a_closed_one_is_not_waited_for(board) -> None:
    _, start = board
    first, gen = start(_leader, "w0"), start(_generator, "w1")
    want = first.ask("publish", 1)
    assert gen.ask("load") == (1, want)
    first.ask("publish", 2)
    assert first.ask("close") == "closed"  # moved away before anyone asked for version 2
    assert gen.ask("load") == (1, want)  # the board names nobody: keep what is held, at once
    second = start(_leader, "w2")  # the new leader takes the lead with the group's state
    want = second.ask("publish", 2)
    assert gen.ask("load") == (2, want)
    assert served(second, (1, 1)) == (1, 1)


def test_a_leader_that_died_is_given_up_on_when_its_successor_publishes(board) -> None:
    store, start = board
    first, gen = start(_leader, "w0"), start(_generator, "w1")
    assert gen.ask("load") == (0, digest(_module(1000)))
    first.ask("publish", 1)
    first.stop()  # SIGKILL: the board still names it, nobody will answer
    second = start(_leader, "w2")
    gen.inbox.put(("load", None))  # waits for an acknowledgement that never comes ...
    want = second.ask("publish", 1)  # ... until the board names the successor
    assert gen.outbox.get(timeout=ANSWER_S) == (0, digest(_module(1000)))  # the old weights, whole
    assert gen.ask("load") == (1, want)


def test_a_ticket_taken_by_a_generator_that_died_is_skipped(board) -> None:
    store, start = board
    leader, gen = start(_leader, "w0"), start(_generator, "w1")
    want = leader.ask("publish", 1)
    tag = store.get("weights/m").decode().split()[1]
    assert store.add(f"asks/{tag}", 1) == 1  # a generator took ticket 1 and died before it asked
    assert gen.ask("load") == (1, want)  # ticket 2, served once ticket 1 is given up (LOST_TICKET_S)
    assert LOST_TICKET_S < ANSWER_S


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_leader_that_follows_stops_serving_and_serves_again_when_it_leads_again(board) -> None:
    _, start = board
    first, second, gen = start(_leader, "w0"), start(_leader, "w2"), start(_generator, "w1")
    first.ask("publish", 1)
    want = second.ask("publish", 2)  # a re-formation: w2 leads, w0 follows
    assert gen.ask("load") == (2, want)
    deadline = time.time() + ANSWER_S
    while first.ask("serving"):  # the follower's server ends once the board has named another for a while
        assert time.time() < deadline, "the follower never stopped serving"
        time.sleep(0.2)
    want = first.ask("publish", 3)  # w0 leads again
    assert gen.ask("load") == (3, want)
    assert served(first, (1, 1)) == (1, 1)


def test_auto_broadcasts_only_where_every_worker_has_a_gpu_of_its_own() -> None:
    replace = msgspec.structs.replace
    cfg = RunConfig()
    assert cfg.pool.weights == "auto" and not broadcasts(cfg)  # a CPU run: the channel
    assert broadcasts(replace(cfg, pool=replace(cfg.pool, weights="broadcast")))  # asked for: gloo on CPUs
    cuda = replace(cfg, pool=replace(cfg.pool, device="cuda"))
    assert broadcasts(cuda) == (torch.cuda.device_count() >= cfg.pool.workers)
    assert not broadcasts(replace(cuda, pool=replace(cuda.pool, weights="channel")))


PEER_THAT_LEAVES = """
import datetime, os, sys
import torch.distributed as dist
host, port = sys.argv[1].rsplit(":", 1)
store = dist.PrefixStore("pair/x/1/", dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                                    timeout=datetime.timedelta(seconds=30)))
dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=30))  # connected: the pair exists ...
os._exit(0)  # ... and its generator dies before the first collective, as a lazily connecting NCCL peer may
"""


def test_a_pair_whose_peer_left_before_any_collective_fails_to_form_within_the_time_out() -> None:
    """NCCL connects on a group's first collective, so without a collective at formation a dead peer would only
    show in the first weight sync; the hello all-reduce makes formation itself fail, as one WeightSyncError
    within the time-out (here on gloo, the same code path as on NCCL), and a peer that never came alike."""
    import subprocess
    import sys

    from engine.weights.broadcast import _pair
    from engine.weights.collective import WeightSyncError

    store, address = open_board("127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_LEAVES, address])
    try:
        started = time.time()
        with pytest.raises(WeightSyncError, match="did not form"):
            _pair(store, "pair/x/1/", 0, torch.device("cpu"), timeout_s=10)
        assert time.time() - started < 30
        assert peer.wait(timeout=30) == 0
        started = time.time()
        with pytest.raises(WeightSyncError, match="did not form"):  # nobody at all
            _pair(store, "pair/y/1/", 0, torch.device("cpu"), timeout_s=2)
        assert time.time() - started < 15
    finally:
        peer.kill()


def test_every_worker_sets_the_nccl_failure_policy_before_any_group() -> None:
    """A timed-out NCCL collective raises and aborts its communicator, without ending the process (torch's default
    tears it down): the values engine.roles.worker puts into its environment."""
    from engine.train.group import NCCL_FAILURE_ENV, set_nccl_failure_env

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # torch's default: tear the process down
    set_nccl_failure_env(env)
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"} == NCCL_FAILURE_ENV
