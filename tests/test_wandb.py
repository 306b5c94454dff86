"""Weights & Biases logging (``run.wandb``, ``monitor --wandb``): real wandb in offline mode, read back from
the ``.wandb`` transaction log it writes (the file ``wandb sync`` uploads). Without wandb installed:
tests/test_engine_config.py."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exchange.records import MetricsWriter
from engine.record.tbevents import scalar_tag
from monitor import wandb_sink
from tests.enginerun import ROOT
from tests.monitorrun import write_run

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402  skips the module without wandb first


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """wandb offline and silent, every file of its own under tmp_path (inherited by the logger's child process)."""
    for var, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CACHE_DIR", "wandb-cache"),
                     ("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(run_dir: Path) -> list:
    """Every record of the one offline W&B run under run_dir: a LevelDB-style log (32 KiB blocks of chunks:
    CRC-32C, length, type) after a 7-byte ``:W&B`` header, each record a ``wandb_internal_pb2.Record``."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, parts, records = 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is whole
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            records.append(rec)
            parts = []
    return records


def history(records: list) -> list[dict]:
    """The logged rows, in order, without W&B's own _step/_runtime/_timestamp."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def expected_rows(run_dir: Path) -> list[dict]:
    """What the learner gives TensorBoard (engine.roles.learner, engine.record.tbevents), as <model>/<tag> on the
    model's step: the warm-start accuracy, every number of a step record (not flags), the final accuracy."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        model = rec.get("model")
        if rec.get("event") == "start":
            rec = {"step": rec["step"], "warm_accuracy": rec["warm_accuracy"],
                   "warm_accuracy_stderr": rec.get("warm_accuracy_stderr")}
        elif rec.get("event") == "final":
            rec = {"step": rec["step"], "final_accuracy": rec["accuracy"],
                   "final_accuracy_stderr": rec.get("accuracy_stderr"), "final_truncated": rec.get("truncated")}
        elif rec.get("event") != "step":
            continue
        values = {f"{model}/{scalar_tag(k)}": v for k, v in rec.items() if k not in ("time", "step")
                  and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        rows.append({f"{model}/step": rec["step"], **values})
    return rows


def add_steps(run_dir: Path, first: int, last: int) -> None:
    """Interleaved steps of both models, every value distinct, a live accuracy now and then, a flag (skipped)."""
    for k in range(first, last + 1):
        for i, model in enumerate(("gpt2", "llama")):
            extra = {"accuracy": 0.3 + k / 100, "accuracy_stderr": 0.01} if k % 2 == 0 else {}
            MetricsWriter(run_dir, model).write(event="step", step=k, reward_mean=k / 10 + i / 100, solo=False,
                                                thl_residual_mean=None, peers_gone=[], **{"obj/sgt_nll": k + i},
                                                **extra)


def test_every_step_and_final_reaches_wandb_as_tensorboard_gets_it(tmp_path):
    """metrics.jsonl as a run writes it (write_run's records, then steps of both models interleaved)."""
    run_dir = write_run(tmp_path / "run", prompts=0)
    add_steps(run_dir, 4, 6)
    MetricsWriter(run_dir, "gpt2").write(event="final", step=6, accuracy=0.75, accuracy_stderr=0.02, truncated=0.25)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"model": "gpt2", "event": "step", "st')  # a line being written: left for a later read
    where = wandb_sink.export(run_dir, "offline", lambda: True)
    assert where is not None and where.parent == run_dir / "wandb"
    records = wandb_records(run_dir)
    rows = history(records)
    assert rows == expected_rows(run_dir)
    assert len(rows) == 2 * (1 + 6 + 1) + 1  # each model's start, 6 steps and final (write_run's), the final above
    assert {"gpt2/eval/warm_accuracy", "gpt2/eval/accuracy", "llama/obj/sgt_nll", "gpt2/eval/final_accuracy",
            "llama/eval/final_accuracy", "gpt2/final_truncated"} <= set().union(*rows)
    assert not any(k.endswith(("/solo", "/time", "/peers_gone")) for row in rows for k in row)  # flags, lists: not
    assert rows[-2]["llama/step"] == 6 and "llama/thl_residual_mean" not in rows[-2]  # nor a null: "not measured"
    axes = {r.metric.glob_name: r.metric.step_metric for r in records
            if r.WhichOneof("record_type") == "metric" and r.metric.glob_name}
    assert axes == {"gpt2/*": "gpt2/step", "llama/*": "llama/step"}  # each model on its own steps
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.display_name == "run" and [m["name"] for m in config["models"]] == ["gpt2", "llama"]
    assert run.run_group == config["run"]["name"]  # run.name groups a config's runs
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished: ready for `wandb sync`


def test_the_runs_logger_follows_it_live_and_finishes_when_told(tmp_path):
    """The launcher's path: a child process follows metrics.jsonl while the run writes it; closing its stdin
    (the run is over) makes it log the rest and finish."""
    run_dir = write_run(tmp_path / "run", prompts=0, steps=1)
    proc = wandb_sink.start(run_dir, "offline")
    add_steps(run_dir, 2, 3)
    time.sleep(1.5)
    add_steps(run_dir, 4, 5)
    started = time.time()
    wandb_sink.finish(proc, timeout_s=45)
    assert proc.returncode == 0 and time.time() - started < 45
    assert history(wandb_records(run_dir)) == expected_rows(run_dir)
    assert wandb_sink.start(run_dir, "off") is None


def test_a_failing_wandb_is_one_warning_line_and_never_raises(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", prompts=0)
    (run_dir / "wandb").write_text("a file where W&B wants its directory")
    assert wandb_sink.export(run_dir, "offline", lambda: True) is None
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: W&B logging of") and "\n" not in err, err


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_monitor_wandb_logs_a_finished_run(tmp_path):
    run_dir = write_run(tmp_path / "run", prompts=0)
    (run_dir / "run_result.json").write_text("{}")
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "monitor", str(run_dir), "--wandb"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wandb sync" in out.stdout and str(run_dir / "wandb" / "offline-run-") in out.stdout
    assert history(wandb_records(run_dir)) == expected_rows(run_dir)

