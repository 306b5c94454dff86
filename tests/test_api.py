"""The Python API (``mutual_rl``): a Trainer from a config with sections changed by keyword, run from a script and
from inside a running event loop (as in a notebook, where an interrupt stops the run as Ctrl-C does), callbacks,
and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mutual_rl import ConfigError, Trainer, TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


def _script(tmp_path: Path, body: str, env: dict | None = None) -> subprocess.Popen:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def docs_example() -> str:
    """The complete example of docs/guides/python-api.md, as written there."""
    page = (ROOT / "docs/guides/python-api.md").read_text()
    return page.split("<!-- example:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def _as_a_user(tmp_path: Path, engine_cache: Path) -> dict:
    """A user's own folder outside the checkout, nothing copied into it (the example names the shipped config
    "smoke"), with the tests' warm-start cache."""
    assert not tmp_path.resolve().is_relative_to(ROOT) and not any(tmp_path.iterdir())
    return {**os.environ, "MUTUAL_RL_CACHE": str(engine_cache)}


def port() -> str:
    """The docs example as a TRL script ported here would have it: the script's own correctness function on the answer
    column and a shaping penalty that never gives full marks, weights 1.0 and 0.2, no "task" among the functions
    (issue 58: with the all-functions rule a success was never seen, and held-out accuracy read 0% silently)."""
    example = docs_example()
    funcs = 'reward_funcs=["task", brief],          # "task": the dataset\'s answer column, checked strictly'
    assert example.count(funcs) == 1 and example.count("\ntrainer = Trainer(") == 1
    return example.replace(funcs, "reward_funcs=[correctness, length_penalty],").replace("\ntrainer = Trainer(", '''
def correctness(prompts, completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]


def length_penalty(prompts, completions, **kwargs):
    return [-len(c[0]["content"]) / 10 for c in completions]


trainer = Trainer(''', 1)


TRL_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
             "completions/min_length", "completions/max_length", "completions/clipped_ratio", "learning_rate",
             "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def check_run(pays: str, shapes: str) -> str:
    """Code run after the example: what its run wrote, printed as one RESULT line; ``pays`` and ``shapes``: its
    reward functions' names (weights 1.0 and 0.2)."""
    return f"TRL_NAMES = {TRL_NAMES + (f'rewards/{shapes}/std',)!r}\nNAMES = {(pays, shapes)!r}\n" + CHECK_RUN


CHECK_RUN = """
import glob, json, math
run_dir = result.run_dir
steps = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"event": "step"' in l]
parts = [(r["reward_mean"], r[f"rewards/{NAMES[0]}/mean"], r[f"rewards/{NAMES[1]}/mean"]) for r in steps]
trl = [{k: r.get(k) for k in TRL_NAMES} for r in steps]
peers = {m: [max(r["peer_experiences"] for r in steps if r["model"] == m),
             max(r["peer_used"] for r in steps if r["model"] == m)] for m in result.models}
from transformers import AutoModelForCausalLM
saved = trainer.save_model(run_dir.parent / ("saved-" + run_dir.name))  # TRL's habit: one directory a model
loaded = {p.name: AutoModelForCausalLM.from_pretrained(p).num_parameters() for p in saved}
print("RESULT", json.dumps({"status": result.status, "run_dir": str(run_dir),
                            "steps": {m: v.steps for m, v in result.models.items()},
                            "accuracy": {m: [v.accuracy_before, v.accuracy_after, v.eval_n] for m, v in result.models.items()},
                            "parts": parts, "trl": trl, "loaded": loaded, "peers": peers,
                            "funcs": sorted(glob.glob(str(run_dir / "inputs" / "*.pkl")))}))
"""


def _check_example_run(out: str, ported: bool = False) -> dict:
    """The run whose RESULT line comes first in ``out``: the docs example's, or ``port()``'s."""
    said = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    shapes = "length_penalty" if ported else "brief"  # the port's shaping penalty: at most 0, never full marks
    assert said["status"] == "finished", out[-3000:]
    assert said["steps"] == {"gpt2": 12, "llama": 12}
    for before, after, n in said["accuracy"].values():
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0 and n == 18  # 30 distinct held out, 18 scored
    assert len(said["parts"]) == 24  # each model's 12 steps, each with both functions' means (TRL's names)
    for mean, task, brief in said["parts"]:
        assert mean == pytest.approx(task + 0.2 * brief) and 0.0 <= task <= 1.0
        assert brief <= 0.0 if ported else 0.0 <= brief <= 1.0
    assert sorted(said["loaded"]) == ["gpt2", "llama"] and all(n > 0 for n in said["loaded"].values())
    for (mean, *_), trl in zip(said["parts"], said["trl"]):  # what a TRL user reads first, under TRL's names
        assert trl["reward"] == pytest.approx(mean) and trl["reward_std"] >= 0.0 and trl["learning_rate"] > 0
        assert 1 <= trl["completions/min_length"] <= trl["completions/mean_length"] <= trl["completions/max_length"]
        assert 0.0 <= trl["completions/clipped_ratio"] <= 1.0 and trl["entropy"] > 0.0
        assert trl["clip_ratio/region_mean"] == pytest.approx(trl["clip_ratio/low_mean"] + trl["clip_ratio/high_mean"])
        assert 0.0 <= trl["frac_reward_zero_std"] <= 1.0 and trl[f"rewards/{shapes}/std"] >= 0.0
    pickled = ["reward-0-correctness.pkl", "reward-1-length_penalty.pkl"] if ported else ["reward-1-brief.pkl"]
    assert [Path(f).name for f in said["funcs"]] == pickled  # the cell's functions, pickled
    config = (Path(said["run_dir"]) / "config.toml").read_text()
    assert all(f'"file:{said["run_dir"]}/inputs/{name}"' in config for name in pickled)  # what a resume reads
    assert "task: 30 held-out problems (eval_fraction=0.1" in out and "Traceback" not in out
    return said


@pytest.mark.slow
def test_the_docs_example_runs_as_written_from_a_script_and_inside_a_running_event_loop(tmp_path, engine_cache):
    """The example as a script runs it (the run goes on this thread), then as a notebook runs a cell (its code at
    the top level of __main__, the kernel's loop running: the run goes on a thread of its own), in one process.
    A TRL-signature function from __main__, with a column of the dataset's, and the task's check, on a
    datasets.Dataset of chat prompts with a system prompt: two models end to end each time; then ``resume``
    re-reads the first run's pickled function and dataset and trains two steps more.

    The second cell is the example ported from a TRL script (``port()``, issue 58): the script's own correctness function
    and a shaping penalty, no "task". The run says at the start what a success is (the answer column's check, not
    full marks from every function, which the penalty never gives), its warm starts meet their stop rule, the
    held-out accuracy counts solved problems, and SGT shares successes."""
    cell = docs_example() + check_run("task", "brief")
    ported = port() + check_run("correctness", "length_penalty")
    proc = _script(tmp_path, f"""
        import asyncio, json

        exec({cell!r}, globals())  # as a script
        first = result.run_dir

        async def kernel():
            asyncio.get_running_loop()  # what the API sees in a notebook
            exec({ported!r}, globals())

        asyncio.run(kernel())
        from mutual_rl import resume
        again = resume(first, quiet=True, **{{"train.steps": 14}})
        print("RESUMED", json.dumps({{"status": again.status, "steps": {{m: v.steps for m, v in again.models.items()}}}}))
    """, _as_a_user(tmp_path, engine_cache))
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-3000:]
    script_said = _check_example_run(out)
    port_out = out.split("RESULT ", 1)[1]
    loop_said = _check_example_run(port_out, ported=True)
    assert loop_said["run_dir"] != script_said["run_dir"]
    port_out = port_out.split("RESULT ", 1)[0]  # what the port's run printed
    assert ("success (held-out accuracy, SGT, the warm start): the task's answer check of the 'answer' column (it "
            "judges, pays nothing: \"task\" is no reward function here); reward = 1 x correctness + 0.2 x "
            "length_penalty (reward.success = 'auto')") in port_out.splitlines(), port_out[-3000:]
    for model in ("gpt2", "llama"):  # the answer check is what the warm start stops on: it never met "all"
        ended = [line for line in port_out.splitlines() if line.startswith(f"warm start {model}: ")][-1]
        assert "reached stop_accuracy 0.2" in ended, port_out[-3000:]  # (or "loaded from cache (it reached ...")
    solved = [max(before, after) for before, after, _ in loop_said["accuracy"].values()]
    assert max(solved) > 0.0, loop_said["accuracy"]  # (the warm starts solve a quarter to a half of the 18)
    assert all(received > 0 for received, _ in loop_said["peers"].values()), loop_said["peers"]  # SGT shared
    assert any(used > 0 for _, used in loop_said["peers"].values()), loop_said["peers"]
    assert "leaked semaphore" not in out  # multiprocessing's warning at exit (tqdm's lock in each actor: quiet_datasets)
    again = json.loads(out.split("RESUMED ", 1)[1].splitlines()[0])
    assert again == {"status": "finished", "steps": {"gpt2": 14, "llama": 14}}, out[-3000:]
    steps = [json.loads(line) for line in (Path(script_said["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "step" and "rewards/brief/mean" in r for r in steps) == 28


@pytest.mark.slow
def test_inside_a_running_event_loop_an_interrupt_stops_the_run_as_ctrl_c_does(tmp_path, engine_cache):
    """A notebook's loop runs in the main thread and its interrupt is a KeyboardInterrupt there: the run goes
    on a thread of its own, and the interrupt stops it with checkpoints and final evaluations."""
    proc = _script(tmp_path, f"""
        import asyncio, json
        from mutual_rl import Trainer

        events = []

        def step(record):  # a plain function: every record, typed
            events.append(type(record).__name__ if not hasattr(record, "final") else
                          "final" if record.final else "live")
            if type(record).__name__ == "StepRecord":
                print("STEP", record.model, record.step, flush=True)

        async def cell():
            trainer = Trainer({str(SMOKE)!r}, run_dir="run", train={{"steps": 1000}}, quiet=True,
                              run={{"cache_dir": {str(engine_cache)!r}, "report": False}}, callbacks=[step])
            return trainer.train()

        result = asyncio.run(cell())
        print("RESULT", json.dumps({{"status": result.status, "events": events,
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
    assert said["status"] == "interrupted" and proc.returncode == 0, said
    assert all(2 <= s < 1000 for s in said["steps"].values()), said  # each model's final came, at its stop
    events = said["events"]  # callbacks: every step record, then each model's final evaluation, then the end
    assert events[-1] == "TrainResult" and events.count("final") == 2, events
    assert 2 <= events.count("StepRecord") <= sum(said["steps"].values()), events  # none for steps while stopping
    assert "Traceback" not in out
    assert "stopped by SIGINT during the run" in (tmp_path / "run" / "INTERRUPTED").read_text()


@pytest.mark.slow
def test_a_callback_stops_the_run_at_a_step_it_chooses_and_resume_finishes_it(tmp_path, engine_cache):
    """A ``TrainerCallback`` stops the run at gpt2's step 3, as Ctrl-C stops it (checkpoints, INTERRUPTED); a plain
    function that raises on every record is named in one line and ignored (``callback_errors="ignore"``); the hooks
    get typed records, live evaluations included; ``resume`` finishes the run: every step, 0 lost, 0 duplicated,
    each model's lineage trained every prompt once."""
    proc = _script(tmp_path, f"""
        import json
        from mutual_rl import EvalRecord, StepRecord, Trainer, TrainerCallback, resume

        class StopAtThree(TrainerCallback):
            def __init__(self):
                self.steps, self.evals, self.ends = [], [], []

            def on_step_end(self, record, control):
                assert isinstance(record, StepRecord) and record.samples > 0
                self.steps.append([record.model, record.step])
                if record.model == "gpt2" and record.step == 3:
                    control.should_training_stop = True

            def on_evaluate(self, record, control):
                assert isinstance(record, EvalRecord) and 0.0 <= record.accuracy <= 1.0
                self.evals.append([record.model, record.step, record.final])

            def on_train_end(self, result):
                self.ends.append(result.status)

        def noisy(record):
            raise ValueError("boom")

        stop = StopAtThree()
        first = Trainer({str(SMOKE)!r}, run_dir="run", quiet=True, train={{"steps": 8}}, eval={{"every_steps": 2}},
                        run={{"cache_dir": {str(engine_cache)!r}, "report": False}}, callbacks=[stop, noisy],
                        callback_errors="ignore").train()
        again = resume("run", quiet=True)
        print("RESULT", json.dumps({{"first": [first.status, {{m: v.steps for m, v in first.models.items()}}],
                                    "again": [again.status, {{m: v.steps for m, v in again.models.items()}}],
                                    "steps": stop.steps, "evals": stop.evals, "ends": stop.ends}}), flush=True)
    """)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-3000:]
    said = json.loads(out.split("RESULT ", 1)[1])
    status, steps = said["first"]
    assert status == "interrupted" and all(3 <= s < 8 for s in steps.values()), said
    assert max(s for m, s in said["steps"] if m == "gpt2") == 3, said["steps"]  # no step hook after the stop
    assert said["ends"] == ["interrupted"] and ["gpt2", 2, False] in said["evals"], said  # a live evaluation
    assert sum(final for *_, final in said["evals"]) == 2, said["evals"]  # each model's final one
    assert "mutual_rl: callback noisy raised ValueError: boom (on_step_end at " in out, out[-3000:]
    assert "the run goes on: callback_errors='ignore')" in out and "Traceback" not in out, out[-3000:]
    assert said["again"] == ["finished", {"gpt2": 8, "llama": 8}], said
    assert not (tmp_path / "run" / "INTERRUPTED").exists()  # the resume's finish removed it; a record keeps why
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(resumed) == 1 and "stopped by callback StopAtThree (on_step_end at gpt2 step 3) during the run" in \
        resumed[0]["previous_end"]["interrupted"], resumed
    result = json.loads((tmp_path / "run" / "run_result.json").read_text())
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0, result["audit"]
    from tests.test_resume import Q, _lineage

    for model in ("gpt2", "llama"):
        assert sorted(_lineage(records, model, 8)) == list(range(8 * Q)), model


def test_a_callback_that_raises_is_one_line_and_stops_the_run_or_not_as_chosen(capsys):
    """``Callbacks``, as the engine calls it on each step: a hook that raises is named in one line; under "stop"
    (the default) it is the reason the run stops, under "ignore" the run goes on; a plain function cannot stop it."""
    from engine.runtime.plane import StepReport
    from mutual_rl.callbacks import Callbacks

    report = StepReport(reward_mean=0.5, staleness_mean=0.0, step_s=1.0, own_total=64, peer_total=8, accuracy=0.25,
                        eval_n=18)

    class Picky(TrainerCallback):
        def on_evaluate(self, record, control):
            raise KeyError(record.model)

    seen = []
    assert Callbacks([seen.append, Picky()]).step("gpt2", 4, report) == \
        "callback test_a_callback_that_raises_is_one_line_and_stops_the_run_or_not_as_chosen.<locals>.Picky raised " \
        "KeyError (on_evaluate at gpt2 step 4)"
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "raised KeyError: 'gpt2' (on_evaluate at gpt2 step 4; stopping the run" in line
    assert [type(r).__name__ for r in seen] == ["StepRecord", "EvalRecord"] and seen[0].samples == 64
    assert Callbacks([Picky()], "ignore").step("gpt2", 4, report) is None
    assert "the run goes on: callback_errors='ignore'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^Trainer\(callback_errors='loud'\): expected one of 'stop', 'ignore'$"):
        Trainer(SMOKE, callback_errors="loud")


def test_a_typed_config_takes_sections_by_keyword_and_a_kind_switched_there_drops_the_other_kinds_fields(capsys):
    from mutual_rl import ModelConfig, RunConfig, TrainSection

    typed = RunConfig(models=[ModelConfig(name="a", arch="gpt2", tokenizer="gpt2")], train=TrainSection(steps=20))
    cfg = Trainer(typed, objective={"kind": "grpo", "kl_coef": 0.01}).config  # the RunConfig's objective: sgt
    assert (cfg.objective.kind, cfg.objective.kl_coef, cfg.train.steps) == ("grpo", 0.01, 20)
    assert "ignoring the RunConfig given's objective lambda" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^Trainer\(objective=\{'kind': 'grpo', 'lambda': 0.2\}\): objective: "
                                          r"unknown field lambda"):
        Trainer(typed, objective={"kind": "grpo", "lambda": 0.2})  # a field the argument gives is still checked


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


SAME = {"models": [{"name": "gpt2", "arch": "gpt2", "tokenizer": "gpt2"}], "objective": {"kind": "grpo"},
        "run": {"mode": "sync", "report": False}, "pool": {"workers": 2}, "train": {"steps": 3}}


@pytest.mark.slow
def test_launch_py_run_and_the_api_train_the_same_weights(tmp_path, engine_cache):
    """``launch.py run`` is a Trainer: the same config and seed train the same weights either way (sync mode, one
    generator: a run that is deterministic)."""
    sets = ['models=[{name = "gpt2", arch = "gpt2", tokenizer = "gpt2"}]', 'objective.kind="grpo"',
            'run.mode="sync"', "run.report=false", "pool.workers=2", "train.steps=3",
            f'run.cache_dir="{engine_cache}"']
    cli = subprocess.run([sys.executable, str(ROOT / "launch.py"), "run", "--config", str(SMOKE),
                          "--run-dir", str(tmp_path / "cli"), *[a for s in sets for a in ("--set", s)]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    api = _script(tmp_path, f"""
        from mutual_rl import Trainer

        same = {SAME!r}
        same["run"]["cache_dir"] = {str(engine_cache)!r}
        raise SystemExit(Trainer({str(SMOKE)!r}, run_dir="api", quiet=True, **same).train(raise_on_failure=True).status != "finished")
    """)
    out = api.communicate(timeout=600)[0]
    assert api.returncode == 0, out[-3000:]

    def trained(run: str) -> tuple[list, bytes]:
        steps = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        rewards = [(r["step"], r["reward_mean"]) for r in steps if r.get("event") == "step"]
        final = tmp_path / run / "checkpoints" / "gpt2" / "step-000003"
        return rewards, b"".join(p.read_bytes() for p in sorted(final.glob("*.safetensors")))

    (cli_rewards, cli_weights), (api_rewards, api_weights) = trained("cli"), trained("api")
    assert len(cli_rewards) == 3 and cli_rewards == api_rewards
    assert cli_weights and cli_weights == api_weights


def test_bad_reward_functions_and_datasets_are_one_line_naming_the_argument():
    import datasets
    import threading

    rows = datasets.Dataset.from_list([{"prompt": f"{i} + 1", "answer": str(i + 1)} for i in range(40)])
    lock = threading.Lock()
    cases = [
        (dict(reward_funcs=[3]), "Trainer(reward_funcs=...): entry 0 is 3 (int), not a function or a name"),
        (dict(reward_funcs=[lambda completions, **kw: [lock.locked()] * len(completions)]),
         "Trainer(reward_funcs=...): _lambda_ cannot be sent to the generator processes (TypeError"),
        (dict(reward_funcs=["task", "exact_answer"], reward_weights=[1.0]),
         "Trainer(reward_weights=[1.0]): reward.weights: gives 1 weights for 2 reward functions"),
        (dict(reward_weights=["x"]), "Trainer(reward_weights=...): entry 0 is 'x', not a number"),
        (dict(reward_funcs=["brief"]), "reward.funcs.0: 'brief': expected \"task\""),
        (dict(train_dataset={"prompt": "1 + 1"}), "Trainer(train_dataset=...): expected a datasets.Dataset or a list "
                                                  "of row dicts, got dict"),
        (dict(train_dataset=rows, task={"prompt": "question"}), "Trainer(train_dataset=...): task.prompt = "
                                                               "'question' is not one of its columns (prompt, answer)"),
        (dict(train_dataset=rows, task={"kind": "countdown"}), "Trainer(train_dataset=...): the task is the dataset, "
                                                              "but task={'kind': 'countdown'} names kind 'countdown'"),
        (dict(train_dataset=rows, task={"answer": ""}), 'reward.funcs: names "task", but task.answer = ""'),
        (dict(eval_dataset=rows), "Trainer(eval_dataset=...): needs a train_dataset too"),
        (dict(train_dataset=[]), "Trainer(train_dataset=...): the list has no rows"),
        (dict(train_dataset=["1 + 1"]), "Trainer(train_dataset=...): a list of rows must hold dicts (column -> value); "
                                        "it holds a str"),
        (dict(train_dataset=datasets.DatasetDict({"train": rows})), "Trainer(train_dataset=...): a DatasetDict (train)"),
    ]
    for kwargs, said in cases:
        with pytest.raises(ConfigError) as err:
            Trainer(SMOKE, **kwargs)
        assert said in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))
    trainer = Trainer(SMOKE, train_dataset=rows, reward_funcs=["task", "exact_answer"], reward_weights=[1, 0.5])
    assert type(trainer.config.task).__name__ == "DatasetConfig" and trainer.config.reward.weights == [1.0, 0.5]
