"""`launch.py monitor`: the aggregation (pure, fed real messages and records), the live attach to a
real broker, the replay of a finished run, and bad input (one sentence, exit 2, never a traceback)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exchange.blocking_publisher import BlockingPublisher
from exchange.broker import BrokerConfig, spawn_broker
from exchange.log import ExperienceLogReader
from exchange.protocol import SCHEMA_VERSION, Control, Stats
from monitor.live import LiveState
from exchange.records import read_records
from monitor.sources import Attached, replay
from monitor.story import Storyteller
from tests.enginerun import ROOT
from tests.monitorrun import T0, experience, write_run


def monitor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "monitor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def fed(run_dir) -> LiveState:
    state = LiveState(["gpt2", "llama"], run=run_dir.name)
    asyncio.run(replay(state, run_dir, 0))
    return state


def test_aggregates_every_model_edge_and_worker(tmp_path):
    state = fed(write_run(tmp_path / "run"))
    snap = json.loads(json.dumps(state.snapshot()))  # plain JSON all through
    assert {m: v["samples"] for m, v in snap["models"].items()} == {"gpt2": 24, "llama": 24}
    assert [len(v["reward"]) for v in snap["models"].values()] == [3, 3]
    assert snap["models"]["llama"]["final_accuracy"] == 0.5
    assert sum(snap["models"]["gpt2"]["staleness"]) == 24
    assert sorted((e["src"], e["dst"]) for e in snap["edges"]) == [("gpt2", "llama"), ("llama", "gpt2")]
    edge = next(e for e in snap["edges"] if e["dst"] == "gpt2")
    assert edge["residual"] == 1.0 and edge["rescue"] == 3.0 and edge["used"] == 6
    assert snap["workers"]["w1"][-1][1:] == ["generator", "gpt2", "learner:llama starved: busy 16%"]
    assert snap["moves"][0]["reason"].startswith("learner:llama starved")
    assert snap["shown"] == 1.0 and snap["missed"] == 0 and snap["ended"]
    assert "generated 24 samples" in state.text()  # generated, not trained: the summary counts those


def test_series_stay_bounded(tmp_path):
    state = LiveState(["gpt2"])
    for k in range(5000):
        state.record({"time": T0 + k, "event": "step", "model": "gpt2", "reward_mean": 0.5, "own_experiences": k})
    assert 700 < len(state.snapshot()["models"]["gpt2"]["reward"]) < 1500


def test_a_sampled_view_takes_its_rates_from_the_broker():
    state = LiveState(["gpt2"])
    for k in range(40):  # 4 samples/s seen over 10 s, 3 tokens each
        state.take(experience("gpt2", k, 0, 0, T0 + k / 4, " 42"))
    seen = state.snapshot()["models"]["gpt2"]
    state.take(Stats(SCHEMA_VERSION, "broker", "broker", "", T0 + 10, 1.0, topic_rates={"exp.gpt2": 400.0},
                     subscriber_dropped={"monitor-1": 3960}))
    state.missed_by("monitor-1")
    sampled = state.snapshot()
    assert sampled["shown"] == 0.01 and sampled["models"]["gpt2"]["samples_per_s"] == 400.0
    assert sampled["models"]["gpt2"]["tokens_per_s"] == pytest.approx(400.0 * seen["tokens_per_s"]
                                                                      / seen["samples_per_s"])
    assert sampled["edges"] == []  # one model, no pair


def test_story_shows_every_model_with_bridged_tokens(tmp_path):
    run_dir = write_run(tmp_path / "run")
    state = fed(run_dir)
    pid = list(state.prompts)[-1]
    story = Storyteller(run_dir).story(pid, state.prompts[pid], list(state.models))
    assert {m: len(s) for m, s in story["models"].items()} == {"gpt2": 4, "llama": 4}
    sample = story["models"]["gpt2"][0]
    bridged = sample["bridged"]["llama"]
    # GPT-2 writes " 6" as one token, Mistral as two (space, digit): one group, residual 1.0
    assert len(sample["tokens"]) == 1 and len(bridged["tokens"]) == 2 and bridged["residual"] == 1.0
    assert bridged["group"] == [0, 0] and "verified" in sample and "staleness" in sample
    # each token's text is its tokenizer's decode of it alone (remembered per id, the same on a second story)
    teller = Storyteller(run_dir)
    for _ in range(2):
        again = teller.story(pid, state.prompts[pid], list(state.models))
        for model, samples in again["models"].items():
            tok = teller.tokenizer(model)
            mine = sorted((e for e, _ in state.prompts[pid] if e.model == model), key=lambda e: e.sample_index)
            for exp, shown in zip(mine, samples, strict=True):
                assert shown["tokens"] == [tok.decode([int(i)]) for i in exp.completion_array], model


def test_once_replays_a_finished_run(tmp_path):
    out = monitor(str(write_run(tmp_path / "run")), "--once")
    assert out.returncode == 0, out.stderr
    assert "48 experiences seen, 0 missed" in out.stdout
    assert "gpt2 -> llama" in out.stdout and "llama -> gpt2" in out.stdout


def test_attaches_to_a_running_broker_and_counts_what_it_sees(tmp_path):
    run_dir = write_run(tmp_path / "run")
    (run_dir / "run_result.json").unlink()  # running
    front, back = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    proc = spawn_broker(BrokerConfig(frontend=front, backend=back, stats_interval_s=0.2))
    (run_dir / "endpoints.json").write_text(json.dumps({"publish": front, "subscribe": back}))
    try:
        state = LiveState(["gpt2", "llama"])
        sent = list(ExperienceLogReader(run_dir / "experience_log"))

        async def watch():
            attached = Attached(back, run_dir)
            await attached.ready(10)
            feeding = asyncio.create_task(attached.feed(state))
            pub = BlockingPublisher(front)
            for e in sent:
                pub.send(e)
            pub.close()
            deadline = time.time() + 30
            while (state.received < len(sent) or not state.broker) and time.time() < deadline:
                await asyncio.sleep(0.05)
            feeding.cancel()
            attached.close()

        asyncio.run(watch())
        assert state.received == len(sent) == 48 and state.missed == 0
        assert state.broker["accepted"] >= 48
        for rec in read_records(run_dir).records:
            state.record(rec)
        assert len(state.snapshot()["edges"]) == 2
    finally:
        stopper = BlockingPublisher(front)
        stopper.send(Control(SCHEMA_VERSION, "stop"))
        stopper.flush()  # send buffers: without this the stop never left, and the broker outlived pytest
        proc.join(20)
        stopper.close(sync_timeout=None)
        assert proc.exitcode == 0, "the broker did not stop on its Control stop"


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_a_cluster_run_with_keys_is_watched_with_the_key_files_its_endpoints_name(tmp_path):
    """A cluster's exchange is CurveZMQ (MUTUAL_RL_CLUSTER_KEYS): endpoints.json names the key files, the
    monitor taps with them; with a stranger's key (--curve-secret) it says so in one sentence."""
    from engine.runtime import actors
    from engine.cluster.node import client_keys, tcp
    from engine.runtime.hub import start_hub, stop_broker
    from exchange.security import make_keys
    from monitor.sources import endpoint_of

    run_dir = write_run(tmp_path / "run")
    (run_dir / "run_result.json").unlink()  # running
    make_keys(tmp_path / "keys", "cluster")
    stranger, _ = make_keys(tmp_path / "stranger", "stranger")
    sent = list(ExperienceLogReader(run_dir / "experience_log"))
    state = LiveState(["gpt2", "llama"])

    async def main():
        hub_dir = tmp_path / "hub" / sent[0].run_id  # the broker takes its own run's experiences only
        hub_dir.mkdir(parents=True)
        hub = await start_hub(hub_dir, tmp_path, ["stats"], "coordinator", 30, (tcp("127.0.0.1"), tcp("127.0.0.1")),
                              client_keys(str(tmp_path / "keys")))
        try:
            (run_dir / "endpoints.json").write_text(json.dumps(hub.endpoints()))
            endpoint, keys = endpoint_of(run_dir)
            attached = Attached(endpoint, run_dir, keys)
            await attached.ready(30)
            feeding = asyncio.create_task(attached.feed(state))
            for e in sent:
                await hub.pub.send(e)
            deadline = time.time() + 30
            while state.received < len(sent) and time.time() < deadline:
                await asyncio.sleep(0.05)
            feeding.cancel()
            attached.close()
            return await asyncio.to_thread(monitor, str(run_dir), "--once", "--attach-timeout", "2",
                                           "--curve-secret", str(stranger.with_suffix(".key_secret")),
                                           "--curve-server", str(tmp_path / "keys" / "cluster.key"))
        finally:
            await stop_broker(hub.pub)
            await hub.pub.aclose()
            hub.sub.close()
            actors.stop_all([hub.actor])

    refused = asyncio.run(asyncio.wait_for(main(), 120))
    assert state.received == len(sent) == 48 and state.missed == 0
    _one_sentence(refused, "no answer with the keys", "stranger.key_secret")


def test_a_live_view_ends_when_the_run_s_broker_closes(tmp_path):
    """The broker's Closing (the run stopped) ends the feed, and the page then says the run ended."""
    front, back = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    proc = spawn_broker(BrokerConfig(frontend=front, backend=back, stats_interval_s=0.2))
    state = LiveState(["gpt2"])
    stopper = BlockingPublisher(front)
    try:
        async def watch():
            attached = Attached(back, tmp_path)
            await attached.ready(10)
            feeding = asyncio.create_task(attached.feed(state))
            while not state.broker:  # the broker's first Stats: the feed is running
                if feeding.done():
                    feeding.result()  # its error, if it failed
                    raise AssertionError("the feed ended before the broker's first Stats")
                await asyncio.sleep(0.05)
            stopper.send(Control(SCHEMA_VERSION, "stop"))
            stopper.flush()
            try:
                await asyncio.wait_for(feeding, 10)
            finally:
                attached.close()

        asyncio.run(asyncio.wait_for(watch(), 60))
        assert state.replay_done and state.snapshot()["ended"]
    finally:
        if proc.is_alive():  # the test failed before its stop: stop the broker anyway
            stopper.send(Control(SCHEMA_VERSION, "stop"))
            stopper.flush()
        proc.join(20)
        stopper.close(sync_timeout=None)
        assert proc.exitcode == 0, "the broker did not stop on its Control stop"


# --- bad input: one sentence on stderr, exit 2 ---

def _one_sentence(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for w in words:
        assert w in out.stderr, out.stderr


def test_missing_run_directory(tmp_path):
    _one_sentence(monitor(str(tmp_path / "nope"), "--once"), "no such run directory")


def test_torn_experience_log(tmp_path):
    run_dir = write_run(tmp_path / "run")
    seg = run_dir / "experience_log" / "00000000.seg"
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a damaged frame with good data after it
    seg.write_bytes(bytes(data))
    _one_sentence(monitor(str(run_dir), "--once"), "experience_log", "damaged")


def test_newer_schema(tmp_path):
    run_dir = write_run(tmp_path / "run", schema=SCHEMA_VERSION + 1)
    _one_sentence(monitor(str(run_dir), "--once"), "newer version", "upgrade")


def test_endpoint_with_nothing_listening(tmp_path):
    run_dir = write_run(tmp_path / "run")
    (run_dir / "run_result.json").unlink()  # looks running, but nothing serves its exchange
    (run_dir / "endpoints.json").write_text(json.dumps({"subscribe": f"ipc://{tmp_path}/gone"}))
    _one_sentence(monitor(str(run_dir), "--once", "--attach-timeout", "1"), "nothing is listening", "--replay")


def test_ctrl_c_with_a_page_streaming_stops_quietly(tmp_path):
    """Ctrl-C on a monitor whose page holds its event stream open: exit 0, no traceback (the stream's
    handler is cancelled at shutdown)."""
    import signal
    import urllib.request

    run_dir = write_run(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "monitor", str(run_dir), "--port", "0",
                             "--no-browser", "--speed", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = proc.stdout.readline().split()[1]
        with urllib.request.urlopen(url + "events", timeout=30) as stream:
            assert stream.readline().startswith(b"data: ")  # the page is streaming
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                raise AssertionError(f"the monitor did not stop within 30 s of its SIGINT; this process's SIGINT "
                                     f"handler: {signal.getsignal(signal.SIGINT)}; the monitor's "
                                     + "; ".join(line for line in status.splitlines()
                                                 if line.startswith(("State", "Sig", "Threads")))) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and "Traceback" not in out and "Error" not in out, out
