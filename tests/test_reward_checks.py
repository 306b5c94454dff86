"""Reward functions checked when a Trainer is built (mutual_rl/reward_check.py): a wrong signature, a wrong
length, a string, a NaN, an exception: each refused in one line naming the function's file:line, before any
process starts; and, in the run, a NaN is an error too unless ``reward.nan = "abstain"``.

The functions live in a real file (as a user's script's do), so that the lines the errors name can be checked."""

from __future__ import annotations

import json
import math
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
    assert str(err.value).startswith('reward function nan returned NaN, an error (reward.nan = "error"): return '
                                     'None to abstain, or set reward.nan = "abstain", on a batch of 3 completions')
    errors: list[str] = []  # train.reward_errors = "zero": the batch scored 0, the line counted
    assert [v.parts[1] for v in task.score(problems, texts, errors)] == [0.0] * 3 and len(errors) == 1


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
def picky(completions, answer, **kwargs):
    """Passes the dry call (each completion there is the answer), raises on the first other completion."""
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[-1]["content"]
        if text.strip() != a:
            raise ValueError("no partial answers here")
    return [1.0] * len(completions)
'''


@pytest.mark.slow
def test_a_function_that_fails_in_the_run_fails_train_and_raise_on_failure_raises(tmp_path, monkeypatch, engine_cache):
    from mutual_rl import TrainingFailed

    (tmp_path / "picky_rewards.py").write_text(PICKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MUTUAL_RL_CACHE", str(engine_cache))
    import picky_rewards

    trainer = Trainer(SMOKE, run_dir=tmp_path / "run", train_dataset=_rows(), reward_funcs=["task", picky_rewards.picky],
                      train={"steps": 4}, run={"report": False}, quiet=True)
    with pytest.raises(TrainingFailed) as err:
        trainer.train(raise_on_failure=True)
    assert err.value.result.status == "failed" and "picky" in str(err.value), str(err.value)
