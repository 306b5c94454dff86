"""The Python API (``mutual_rl``): a Trainer from a config with sections changed by keyword, run from a script and
from inside a running event loop (as in a notebook, where an interrupt stops the run as Ctrl-C does), callbacks,
and one-line errors for bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mutual_rl import ConfigError, Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


def _script(tmp_path: Path, body: str) -> subprocess.Popen:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_script_trains_to_the_end_and_gets_each_models_figures(tmp_path, engine_cache):
    proc = _script(tmp_path, f"""
        import json
        from mutual_rl import Trainer

        seen = []
        result = Trainer({str(SMOKE)!r}, run_dir="run", run={{"cache_dir": {str(engine_cache)!r}, "report": True}},
                         callbacks=[seen.append], quiet=True).train()
        steps = sorted((r["model"], r["step"]) for r in seen if r["event"] == "step")
        print("RESULT", json.dumps({{"status": result.status, "code": result.exit_code, "steps": steps,
                                    "events": sorted({{r["event"] for r in seen}}),
                                    "report": str(result.report), "models": {{m: [v.accuracy_before, v.accuracy_after,
                                    v.eval_n, v.steps, v.samples] for m, v in result.models.items()}}}}))
    """)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-3000:]
    said = json.loads(out.split("RESULT ", 1)[1])
    assert said["status"] == "finished" and said["code"] == 0
    assert said["events"] == ["end", "final", "step"]
    assert said["steps"] == sorted([m, k] for m in ("gpt2", "llama") for k in range(1, 13))  # each step once
    for model, (before, after, n, steps, samples) in said["models"].items():
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0 and n == 18 and steps == 12 and samples > 0, model
    assert said["report"] == str(tmp_path / "run" / "report.md") and (tmp_path / "run" / "report.md").exists()


@pytest.mark.slow
def test_inside_a_running_event_loop_an_interrupt_stops_the_run_as_ctrl_c_does(tmp_path, engine_cache):
    """A notebook's loop runs in the main thread and its interrupt is a KeyboardInterrupt there: the run goes
    on a thread of its own, and the interrupt stops it with checkpoints and final evaluations."""
    proc = _script(tmp_path, f"""
        import asyncio, json
        from mutual_rl import Trainer

        def step(record):
            if record["event"] == "step":
                print("STEP", record["model"], record["step"], flush=True)

        async def cell():
            trainer = Trainer({str(SMOKE)!r}, run_dir="run", train={{"steps": 1000}}, quiet=True,
                              run={{"cache_dir": {str(engine_cache)!r}, "report": False}}, callbacks=[step])
            return trainer.train()

        result = asyncio.run(cell())
        print("RESULT", json.dumps({{"status": result.status, "code": result.exit_code,
                                    "steps": {{m: v.steps for m, v in result.models.items()}}}}), flush=True)
    """)
    lines = []
    deadline = time.time() + 600
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("STEP") and int(line.split()[2]) >= 2:
            break
        assert time.time() < deadline, "no step 2 within 600 s:\n" + "".join(lines[-50:])
    proc.send_signal(signal.SIGINT)  # to the kernel's process alone, as a notebook's interrupt is
    out = "".join(lines) + proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    said = json.loads(out.split("RESULT ", 1)[1])
    assert said["status"] == "interrupted" and said["code"] == 130, said
    assert all(2 <= s < 1000 for s in said["steps"].values()), said  # each model's final came, at its stop
    assert "Traceback" not in out
    assert "stopped by SIGINT during the run" in (tmp_path / "run" / "INTERRUPTED").read_text()


def test_bad_input_is_one_error_that_names_the_argument(tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, train={"lr": "fast"})
    assert str(err.value).startswith("Trainer(train={'lr': 'fast'}): train.lr: expected float, got str"), err.value
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, train={"stpes": 3})
    assert "train: unknown field stpes (did you mean steps?)" in str(err.value), err.value
    with pytest.raises(ConfigError) as err:
        Trainer({"models": [{"name": "a", "arch": "gpt2", "tokenizer": "gpt2"}]}, objective={"kind": "sgt"})
    assert "objective.kind" in str(err.value) and "needs >= 2 models" in str(err.value), err.value
    cfg = Trainer(SMOKE, train={"steps": 3}, run={"seed": 7}).config
    assert (cfg.train.steps, cfg.run.seed, cfg.train.prompts_per_step) == (3, 7, 8)  # the rest of the file kept
    assert "\n" not in str(err.value)
