"""Reward functions checked when a Trainer is built (mutual_rl/reward_check.py): a wrong signature, a wrong
length, a string, a NaN, an exception: each refused in one line naming the function's file:line, before any
process starts; and, in the run, a NaN is an error too unless ``reward.nan = "abstain"``.

The functions live in a real file (as a user's script's do), so that the lines the errors name can be checked."""

from __future__ import annotations

import collections
import importlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mutual_rl import ConfigError, Trainer
from tasks.base import VerifierError
from tasks.dataset import DatasetConfig
from tasks.registry import make_task
from tasks.rewards import RewardedTask

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"

USER = '''
import json
import math

def good(prompts, completions, budget, **kwargs):
    return [1.0 if len(c) <= b else 0.0 for c, b in zip(completions, budget)]

def needs_tone(completions, tone, **kwargs):
    return [0.0] * len(completions)

def short(completions, **kwargs):
    return [1.0]

def silent(completions, **kwargs):
    return [None] * len(completions)

def words(completions, **kwargs):
    return ["yes"] * len(completions)

def nan(completions, **kwargs):
    return [math.nan] * len(completions)

def one(completions, **kwargs):
    return 1.0

def _dry(completions, answer):
    """Whether this is the Trainer's dry call: each completion its row's answer."""
    return all((c if isinstance(c, str) else c[-1]["content"]).strip() == a for c, a in zip(completions, answer))

def late_raise(completions, answer, **kwargs):
    if not _dry(completions, answer):
        raise ValueError("no partial answers here")
    return [1.0] * len(completions)

def late_short(completions, answer, **kwargs):
    return [1.0] * len(completions) if _dry(completions, answer) else [1.0]

def late_none(completions, answer, **kwargs):
    return [1.0] * len(completions) if _dry(completions, answer) else None

def late_string(completions, answer, **kwargs):
    return [1.0] * len(completions) if _dry(completions, answer) else "1.0"

def late_strings(completions, answer, **kwargs):
    return [1.0] * len(completions) if _dry(completions, answer) else ["1.0"] * len(completions)

def late_nan(completions, answer, **kwargs):
    return [1.0] * len(completions) if _dry(completions, answer) else [math.nan] * len(completions)

def boom(completions, budget, **kwargs):
    scores = []
    for c in completions:
        scores.append(json.loads("{" + c))  # raised in json's own file, called from this line
    return scores
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The module ``user_rewards`` (a user's file) and a dataset with a column of its own."""
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(USER))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import user_rewards

    return importlib.reload(user_rewards), path


def _rows(n: int = 40) -> list[dict]:
    return [{"prompt": f"{i} + 1", "answer": str(i + 1), "budget": 4} for i in range(n)]


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _refused(func, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, train_dataset=_rows(), reward_funcs=["task", func], **kwargs)
    said = str(err.value)
    assert "\n" not in said, said
    return said


@pytest.mark.parametrize("name, said", [
    ("needs_tone", "takes tone, which it will not be given (arguments come by keyword: prompts, completions, "
                   "completion_ids, problem, answer, budget); give tone a default, or add a column"),
    ("short", "returned 1 values for 4 completions (one each, None to abstain), on a dry call with the first 4 rows "
              "of train_dataset, each completion the reference answer"),
    ("words", "returned 'yes' (str) for completion 0, not a float or None"),
    ("nan", 'returned NaN for completion 0: NaN is an error, not an abstention (return None to abstain, or pass '
            'reward_nan="abstain" to read NaN as None)'),
    ("one", "returned 1.0 (float), not a list of 4 floats (None to abstain)"),
])
def test_a_broken_function_is_refused_in_one_line_naming_its_file_and_line(user, name, said):
    module, path = user
    got = _refused(getattr(module, name))
    assert got.startswith(f"Trainer(reward_funcs=...): {name} ({path}:{_line(path, f'def {name}(')}) "), got
    assert said in got, got


def test_an_exception_names_the_users_line_that_raised_it(user):
    module, path = user
    got = _refused(module.boom)
    raised = _line(path, 'json.loads("{" + c)')
    assert got.startswith(f"Trainer(reward_funcs=...): boom ({path}:{_line(path, 'def boom(')}) raised "
                          "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
                          f"(char 1) at {path}:{raised}, on a dry call with the first 4 rows of train_dataset"), got


def test_a_good_function_and_one_that_abstains_everywhere_pass(user):
    module, _ = user
    trainer = Trainer(SMOKE, train_dataset=_rows(), reward_funcs=["task", module.good, module.silent])
    assert trainer.config.reward.nan == "error"
    ok = Trainer(SMOKE, train_dataset=_rows(), reward_funcs=["task", module.nan], reward_nan="abstain")
    assert ok.config.reward.nan == "abstain"  # the opt-in: NaN read as None, as TRL reads it


def test_a_function_named_by_its_module_is_checked_against_the_configs_own_task(user):
    """No dataset given: the smoke config's arithmetic problems are the dry call's, and its columns (none of a
    dataset's) are what the signature is checked against."""
    _, path = user
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, reward={"funcs": ["task", "user_rewards:good"]})
    said = str(err.value)
    assert said.startswith(f"reward.funcs: good ({path}:{_line(path, 'def good(')}) takes budget, which it will not "
                           "be given (arguments come by keyword: prompts, completions, completion_ids, problem, "
                           "answer)"), said
    with pytest.raises(ConfigError, match='or set reward.nan = "abstain" to read NaN as None'):
        Trainer(SMOKE, reward={"funcs": ["user_rewards:nan"]})
    Trainer(SMOKE, reward={"funcs": ["user_rewards:silent"]})  # abstains: fine


def test_launch_py_run_checks_the_configs_functions_as_a_trainer_does(user):
    """``launch.py run`` refuses the function a Trainer refuses, in one line and before anything is written."""
    _, path = user
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "run", "--config", str(SMOKE), "--run-dir",
                           str(path.parent / "run"), "--set", 'reward.funcs=["task", "user_rewards:good"]'],
                          cwd=path.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith(f"error: reward.funcs: good ({path}:{_line(path, 'def good(')}) takes budget"), \
        done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (path.parent / "run").exists()


def test_a_bad_reward_nan_is_one_line_naming_the_argument():
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, reward_nan="skip")
    assert str(err.value).startswith("Trainer(reward_nan='skip'): reward.nan: "), err.value


@pytest.fixture
def dataset_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(60)))
    return path


@pytest.mark.parametrize("nan, abstains", [("error", False), ("abstain", True)])
def test_in_the_run_a_nan_is_an_error_unless_it_may_abstain(user, dataset_file, nan, abstains):
    task = RewardedTask(make_task(DatasetConfig(path=str(dataset_file), eval_fraction=0.2)),
                        ["task", "user_rewards:nan"], [1.0, 1.0], nan=nan)
    problems = [task.problem(i) for i in range(3)]
    texts = [p.answer for p in problems]
    if abstains:
        verdicts = task.score(problems, texts)
        assert all(math.isnan(v.parts[1]) and v.reward == 1.0 for v in verdicts)  # the task's 1.0 alone
        return
    with pytest.raises(VerifierError) as err:
        task.score(problems, texts)
    _, path = user
    assert str(err.value).startswith(f'reward function nan ({path}:{_line(path, "def nan(")}) returned NaN, an error '
                                     '(reward.nan = "error"): return None to abstain, or set reward.nan = "abstain", '
                                     'on a batch of 3 completions')
    errors: list[str] = []  # train.reward_errors = "zero": the batch scored 0, the line counted
    assert [v.parts[1] for v in task.score(problems, texts, errors)] == [0.0] * 3 and len(errors) == 1


@pytest.mark.parametrize("name, said", [
    ("late_raise", "raised ValueError: no partial answers here at {path}:{raised}"),
    ("late_short", "returned 1 values for 3 completions"),
    ("late_none", "returned None (NoneType), not a list of 3 floats (None to abstain)"),
    ("late_string", "returned '1.0' (str), not a list of 3 floats (None to abstain)"),
    ("late_strings", "returned '1.0' (str), not a float or None"),
    ("late_nan", 'returned NaN, an error (reward.nan = "error"): return None to abstain, or set reward.nan = '
                 '"abstain"'),
])
def test_a_function_that_goes_wrong_only_past_the_dry_call_is_one_line_in_the_run_as_one_that_raises(
        user, dataset_file, name, said):
    """Each passes the Trainer's dry call (each completion the answer) and goes wrong on the run's completions:
    a wrong length, None, a string, strings, NaN are each the same one-line VerifierError as a raise (which a
    generator sends as RewardFailed: the run stops, the slow test below), naming the function and its file:line;
    scored 0 with the line kept where train.reward_errors = "zero"; and an evaluation, whose successes the answer
    check decides, never calls it."""
    module, path = user
    Trainer(SMOKE, train_dataset=_rows(), reward_funcs=["task", getattr(module, name)])  # the dry call passes
    task = RewardedTask(make_task(DatasetConfig(path=str(dataset_file), eval_fraction=0.2)),
                        ["task", f"user_rewards:{name}"], [1.0, 1.0])
    problems = [task.problem(i) for i in range(3)]
    wrong = [str(int(p.answer) + 1) for p in problems]
    with pytest.raises(VerifierError) as err:
        task.score(problems, wrong)
    got = str(err.value)
    said = said.format(path=path, raised=_line(path, 'raise ValueError("no partial answers here")'))
    assert got.startswith(f"reward function {name} ({path}:{_line(path, f'def {name}(')}) {said}, on a batch of 3 "
                          f"completions (the first of problem {problems[0].prompt_id}: "), got
    assert "\n" not in got
    errors: list[str] = []
    assert [v.parts[1] for v in task.score(problems, wrong, errors)] == [0.0] * 3 and errors == [got]
    judged = task.score(problems, wrong, only_success=True)  # as every evaluation scores: the answer check alone
    assert [v.verified for v in judged] == [False] * 3 and all(math.isnan(v.parts[1]) for v in judged)


def test_what_a_success_is_when_the_functions_do_not_say(user):
    """A TRL script's functions (a correctness check and a shaping penalty, no "task"): with an answer column a
    success is the task's answer check; without one, nothing defines it and the Trainer says so in one line;
    success= names a function, a threshold, or is a function of its own that pays nothing."""
    module, _ = user
    trainer = Trainer(SMOKE, train_dataset=_rows(), reward_funcs=[module.good, module.silent], quiet=True)
    assert trainer.config.reward.success == "auto"
    no_answers = [{"prompt": r["prompt"], "budget": r["budget"]} for r in _rows()]
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, train_dataset=no_answers, task={"answer": ""}, reward_funcs=[module.good])
    said = str(err.value)
    assert "\n" not in said and "reward.success" in said and "nothing defines a success" in said, said
    named = Trainer(SMOKE, train_dataset=no_answers, task={"answer": ""}, reward_funcs=[module.good], success=0.5)
    assert named.config.reward.success == 0.5
    judged = Trainer(SMOKE, train_dataset=no_answers, task={"answer": ""}, reward_funcs=[module.good],
                     success=module.silent)
    r = judged.config.reward
    assert r.success == "silent" and r.weights == [1.0, 0.0] and len(r.funcs) == 2  # it judges, pays nothing
    with pytest.raises(ConfigError, match="reward.success: 'nope' names no reward function"):
        Trainer(SMOKE, reward_funcs=["task", "exact_answer"], success="nope")


PICKY = '''
import json
import os

CALLS = {calls!r}


def picky(completions, answer, **kwargs):
    """Writes down each call (its process, its completions); pays the answer, and raises from a process's third
    call on (the dry call is the test's process's first)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    with open(CALLS, "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "texts": texts}}) + "\\n")
    with open(CALLS) as f:
        mine = sum(json.loads(line)["pid"] == os.getpid() for line in f)
    if mine > 2:
        raise ValueError("no partial answers here")
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answer)]
'''


def _picky_run(tmp_path: Path, monkeypatch, engine_cache: Path, module: str, **settings):
    """configs/smoke.toml paid by the task's check and ``picky`` (written as ``module``.py), six sync steps, run by
    ``train(raise_on_failure=True)``: picky's file, its calls, the run directory and the TrainingFailed raised."""
    from mutual_rl import TrainingFailed

    calls = tmp_path / "calls.jsonl"
    path = tmp_path / f"{module}.py"
    path.write_text(PICKY.format(calls=str(calls)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MUTUAL_RL_CACHE", str(engine_cache))
    picky = importlib.import_module(module).picky
    run_dir = tmp_path / "run"
    trainer = Trainer(SMOKE, run_dir=run_dir, train_dataset=_rows(), reward_funcs=["task", picky],
                      train={"steps": 6, "max_model_lead_steps": 1}, run={"report": False, "mode": "sync"}, quiet=True,
                      **settings)
    with pytest.raises(TrainingFailed) as err:
        trainer.train(raise_on_failure=True)
    return path, calls, run_dir, err.value


@pytest.mark.slow
def test_a_function_that_fails_in_the_run_is_one_line_and_the_run_stops_with_its_last_checkpoints(
        tmp_path, monkeypatch, engine_cache, capfd):
    """A function that passes the dry call and raises in the run's third step (sync mode: every learner has taken
    two steps by then): the one line that names it, with its file and the line that raised, is all the user sees
    of it (no traceback); each model's learner keeps the checkpoint of the step it reached; the final evaluations
    (whose successes the answer check decides) do not call it again; train(raise_on_failure=True) raises."""
    path, calls, run_dir, failed = _picky_run(tmp_path, monkeypatch, engine_cache, "picky_rewards")
    out, errs = capfd.readouterr()
    seen = out + errs
    said = (f"reward function picky ({path}:{_line(path, 'def picky(')}) raised ValueError: no partial answers here "
            f"at {path}:{_line(path, 'raise ValueError')}, on a batch of 64 completions")
    assert failed.result.status == "failed" and str(failed).startswith(said), str(failed)
    named = [line for line in seen.splitlines() if "reward function picky" in line]
    assert len(named) == 1 and said in named[0], seen  # said once, in one line
    assert "Traceback" not in seen and "exited with code" not in seen, seen

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for model in ("gpt2", "llama"):
        reached = max(r["step"] for r in records if r.get("model") == model and r["event"] == "step")
        final = next((r for r in records if r.get("model") == model and r["event"] == "final"), {})
        kept = json.loads((run_dir / "checkpoints" / model / "latest" / "state.json").read_text())["step"]
        assert reached >= 2 and final.get("step") == kept == reached, (model, reached, final, kept)

    made = [json.loads(line) for line in calls.read_text().splitlines()]
    dry = [c for c in made if c["pid"] == os.getpid()]
    in_run = [c for c in made if c["pid"] != os.getpid()]
    assert len(dry) == 1 and len(dry[0]["texts"]) == 4  # the Trainer's dry call, here
    # every call in the run is a generator's, on a step (8 prompts x 8 samples): none from the warm starts' or the
    # learners' evaluations (the final ones: 2 held-out problems), and no generator called it after it raised
    pids = json.loads((run_dir / "pids.json").read_text())
    roles = next(r for r in records if r["event"] == "allocation")["workers"]
    generators = {pids[w] for w, (role, _) in roles.items() if role == "generator"}
    per_process = collections.Counter(c["pid"] for c in in_run)
    assert set(per_process) <= generators, (per_process, pids, roles)
    assert {len(c["texts"]) for c in in_run} == {64}, [len(c["texts"]) for c in in_run]
    assert set(per_process.values()) <= {2, 3} and 3 in per_process.values(), per_process


@pytest.mark.slow
def test_where_the_function_that_failed_judges_success_the_final_evaluation_is_skipped_not_run(
        tmp_path, monkeypatch, engine_cache, capfd):
    """``success="picky"``: the held-out evaluation would call the function that stopped the run, so each model's
    final evaluation is skipped, with no figures (not zeros); the checkpoints stand; no learner
    calls it (no warm start: the models start as built)."""
    _, calls, run_dir, _ = _picky_run(tmp_path, monkeypatch, engine_cache, "picky_rewards2", success="picky",
                                      warmstart={"steps": 0})
    out, errs = capfd.readouterr()
    seen = out + errs
    assert sum("reward function picky" in line for line in seen.splitlines()) == 1, seen
    assert "Traceback" not in seen and "exited with code" not in seen, seen
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for model in ("gpt2", "llama"):
        final = next(r for r in records if r.get("model") == model and r["event"] == "final")
        kept = json.loads((run_dir / "checkpoints" / model / "latest" / "state.json").read_text())["step"]
        assert final["accuracy"] is None and final["eval_n"] == 0 and final["step"] == kept >= 2, final
    pids = json.loads((run_dir / "pids.json").read_text())
    roles = next(r for r in records if r["event"] == "allocation")["workers"]
    learners = {pids[w] for w, (role, _) in roles.items() if role == "learner"}
    assert not learners & {json.loads(line)["pid"] for line in calls.read_text().splitlines()}
