"""Reward functions in TRL's shape (tasks/rewards.py): batched, with the row's columns as keyword arguments,
weighted, abstaining with None; the success rule; each bad function one line naming it; the config's checks."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import cloudpickle
import pytest

from engine.config import ConfigError, load_run_config
from tasks.base import Problem, VerifierError
from tasks.dataset import DatasetConfig
from tasks.jsonl import JsonlConfig
from tasks.registry import make_task
from tasks.rewards import RewardLoadError, exact_answer, load_reward

REWARDS = '''
def brief(prompts, completions, budget, **kwargs):
    return [1.0 if len(c) <= b else 0.0 for c, b in zip(completions, budget)]

def named_only(completions, answer):  # no **kwargs: gets only what it names
    return [None if a == "4" else 0.5 for a in answer]

def seen(prompts, completions, **kwargs):
    return [float(len(kwargs["problem"]) == len(completions) and "completion_ids" in kwargs)] * len(completions)

def boom(completions, **kwargs):
    raise KeyError("budget")

def short(completions, **kwargs):
    return [1.0]

def words(completions, **kwargs):
    return ["yes"] * len(completions)
'''


@pytest.fixture
def dataset_file(tmp_path, monkeypatch):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "budget": 8 + i % 3} for i in range(1, 60)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def _task(path, funcs, weights=()):
    return make_task(DatasetConfig(path=str(path), eval_fraction=0.2), funcs, weights)


def test_the_reward_is_the_weighted_sum_of_the_functions_that_judged(dataset_file):
    task = _task(dataset_file, ["task", "my_rewards:brief", "my_rewards:named_only"], [1.0, 0.5, 2.0])
    problems = [task.problem(i) for i in range(3)]
    texts = [f"It is {problems[0].answer}", f"The answer is {problems[1].answer} for sure", "99"]
    verdicts = task.score(problems, texts)
    for p, text, v in zip(problems, texts, verdicts):
        brief = float(len(text) <= p.columns["budget"])
        assert v.parts[1] == brief
        assert math.isnan(v.parts[2]) if p.answer == "4" else v.parts[2] == 0.5  # None: abstained
        assert v.reward == pytest.approx(v.parts[0] + 0.5 * brief + (0.0 if p.answer == "4" else 2.0 * 0.5))
        assert v.verified == (v.parts[0] == 1.0)  # "task" decides the success, whatever the others say
    assert verdicts[0].parts[0] == 1.0 and verdicts[2].parts[0] == 0.0
    assert task.names == ["task", "brief", "named_only"]


def test_a_success_is_the_answer_check_by_default_and_what_reward_success_says_otherwise(dataset_file):
    """With an answer column, a success is the task's answer check even where "task" pays nothing (a TRL script's
    correctness function and a length penalty: full marks from every function is never reached, and SGT, the
    warm start and held-out accuracy counted nothing); reward.success picks another rule."""
    funcs = ["my_rewards:named_only", "exact_answer"]
    four, other = (Problem(prompt_id=i, task="dataset", question=f"{a} / 2?", answer=str(a)) for i, a in enumerate((4, 6)))
    wrong = Problem(prompt_id=2, task="dataset", question="8 / 2?", answer="8")

    def verdicts(success):
        return make_task(DatasetConfig(path=str(dataset_file), eval_fraction=0.2), funcs, (), success).score(
            [four, other, wrong], [four.answer, other.answer, "5"])

    v4, vo, vw = verdicts("auto")
    assert v4.verified and vo.verified and not vw.verified  # the answer check: right, right, wrong
    assert (v4.reward, vo.reward, vw.reward) == (1.0, 1.5, 0.5)  # the reward is the functions' alone
    v4, vo, vw = verdicts("all")  # every function that judged gave full marks (named_only's 0.5 is not)
    assert v4.verified and not vo.verified and not vw.verified
    assert [v.verified for v in verdicts("named_only")] == [False, False, False]  # abstained, 0.5, 0.5
    assert [v.verified for v in verdicts(1.5)] == [False, True, False]  # the weighted reward at least 1.5
    with pytest.raises(RewardLoadError, match="reward.success = 'brevity': names no reward function"):
        verdicts("brevity")


def test_the_run_says_at_the_start_what_a_success_is_where_the_reward_is_the_users_functions(dataset_file):
    """One line (engine.session.success_note, printed before the run starts) names the rule and what pays, so a
    shaping penalty cannot silently decide every success; the task's own check alone needs none."""
    from engine.session import success_note

    config = DatasetConfig(path=str(dataset_file), eval_fraction=0.2)
    funcs, weights = ["my_rewards:named_only", "my_rewards:brief"], [1.0, 0.2]
    said = {rule: success_note(make_task(config, funcs, weights, rule), rule) for rule in ("auto", "all", "brief", 0.5)}
    head = "success (held-out accuracy, SGT, the warm start): "
    assert said["auto"] == (head + "the task's answer check of the 'answer' column (it judges, pays nothing: \"task\" "
                            "is no reward function here); reward = 1 x named_only + 0.2 x brief (reward.success = 'auto')")
    assert said["all"].startswith(head + "full marks (1.0) from every reward function that judged; reward = ")
    assert said["brief"].startswith(head + "full marks (1.0) from brief; ")
    assert said[0.5].startswith(head + "a weighted reward of at least 0.5; ")
    assert all("\n" not in line for line in said.values())
    judged = make_task(config, [*funcs, "my_rewards:brief"], [1.0, 0.2, 0.0], "brief_2")  # success=function
    assert "full marks (1.0) from brief_2 (weight 0: it judges, pays nothing); reward = 1 x named_only + 0.2 x " \
           "brief_1 (" in success_note(judged, "brief_2")
    with_task = make_task(config, ["task", "my_rewards:brief"], [1.0, 0.2])
    assert "answer check of the 'answer' column; reward = 1 x task + 0.2 x brief" in success_note(with_task, "auto")
    assert success_note(make_task(config), "auto") is None


def test_functions_get_the_batch_with_problem_and_completion_ids(dataset_file):
    task = _task(dataset_file, ["my_rewards:seen"])
    problems = [task.problem(i) for i in range(4)]
    assert [v.reward for v in task.score(problems, ["a"] * 4, completion_ids=[[1]] * 4)] == [1.0] * 4


@pytest.mark.parametrize("name, said", [
    ("boom", "raised KeyError: 'budget' at "),
    ("short", "returned 1 values for 3 completions"),
    ("words", "returned 'yes' (str), not a float or None"),
])
def test_a_bad_function_is_one_line_naming_it_or_zero_with_the_line_counted(dataset_file, name, said):
    task = _task(dataset_file, [f"my_rewards:{name}"])
    problems = [task.problem(i) for i in range(3)]
    defined = sys.modules["my_rewards"].__file__  # imported once per session, from the first test's folder
    line = next(i for i, text in enumerate(open(defined).read().splitlines(), 1) if f"def {name}(" in text)
    said = f"reward function {name} ({defined}:{line}) {said}"  # where it is defined, as the Trainer's check says
    with pytest.raises(VerifierError) as err:
        task.score(problems, ["1", "2", "3"])
    assert str(err.value).startswith(said) and "\n" not in str(err.value)
    assert f"(the first of problem 0: {problems[0].question!r})" in str(err.value)
    errors: list[str] = []
    assert [v.reward for v in task.score(problems, ["1", "2", "3"], errors)] == [0.0] * 3
    assert len(errors) == 1 and errors[0].startswith(said)


@pytest.mark.parametrize("spec, said", [
    ("my_rewards:nope", "reward function 'my_rewards:nope': my_rewards has no function 'nope'"),
    ("no_such_module:f", "reward function 'no_such_module:f': cannot import 'no_such_module' (ModuleNotFoundError"),
    ("file:/no/such.pkl", "reward function file:/no/such.pkl: no such file"),
    ("brief", "reward function 'brief': expected \"task\", 'exact_answer', \"module:function\" or \"file:PATH\""),
])
def test_a_function_that_does_not_load_is_one_line(dataset_file, spec, said):
    with pytest.raises(RewardLoadError) as err:
        _task(dataset_file, [spec])
    assert str(err.value).startswith(said)


def test_a_pickled_function_loads_from_its_file(tmp_path):
    budget = 3
    path = tmp_path / "f.pkl"
    path.write_bytes(cloudpickle.dumps(lambda completions, **kw: [float(len(c) <= budget) for c in completions]))
    func = load_reward(f"file:{path}")
    assert func(prompts=["q", "q"], completions=["ab", "abcd"]) == [1.0, 0.0]


def test_the_default_reward_is_the_task_itself(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}", "answer": str(2 * i)}) for i in range(40)))
    task = make_task(JsonlConfig(path=str(path)))
    assert not hasattr(task, "names")  # no wrapper: the verifier is called as before


def test_exact_answer_reads_the_one_answer_strictly():
    chat = [{"role": "assistant", "content": "so it is 12"}]
    got = exact_answer(["q"] * 5, ["12", "The answer is 12.", "2abc12x", chat, "12"], ["12", "12", "12", "12", ""])
    assert got == [1.0, 1.0, 0.0, 1.0, None]


@pytest.mark.parametrize("reward, said", [
    ('funcs = []', 'reward.funcs: names no function'),
    ('funcs = ["task", "exact_answer"]\nweights = [1.0]', "reward.weights: gives 1 weights for 2 reward functions"),
    ('funcs = ["brief"]', "reward.funcs.0: 'brief': expected"),
])
def test_the_config_checks_the_reward_section(tmp_path, reward, said):
    path = tmp_path / "c.toml"
    path.write_text(f'[[models]]\nname = "a"\narch = "gpt2"\ntokenizer = "gpt2"\n\n[objective]\nkind = "grpo"\n\n[reward]\n{reward}\n')
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert said in str(err.value) and str(err.value).startswith(str(path))


def test_the_task_verifier_needs_an_answer_column(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[models]]\nname = "a"\narch = "gpt2"\ntokenizer = "gpt2"\n\n[objective]\nkind = "grpo"\n\n'
                    '[task]\nkind = "dataset"\npath = "x.jsonl"\nanswer = ""\n')
    with pytest.raises(ConfigError, match='reward.funcs: names "task", but task.answer = ""'):
        load_run_config(path)


def test_problems_carry_their_columns_on_the_wire():
    import msgspec

    p = Problem(prompt_id=1, task="t", question="q", answer="a", messages=[{"role": "user", "content": "q"}],
                columns={"budget": 3, "tags": ["x"]})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=Problem) == p and p.prompt == p.messages


def test_the_tasks_verifier_is_a_reward_function_trl_can_call(tmp_path):
    from tasks.arithmetic import ArithmeticConfig
    from tasks.rewards import TaskReward

    task = make_task(ArithmeticConfig())
    reward = TaskReward(task)
    problems = [task.problem(i) for i in range(3)]
    chat = [[{"role": "assistant", "content": f" {p.answer}"}] for p in problems[:2]] + [[{"role": "assistant",
                                                                                           "content": "no"}]]
    # as TRL's GRPOTrainer calls it: prompts, completions, and the dataset's columns (here the problem's id)
    assert reward(prompts=[p.question for p in problems], completions=chat, prompt_id=[0, 1, 2]) == [1.0, 1.0, 0.0]
    assert reward.__name__ == "task"  # what TRL logs it under, as this project does
    assert reward(prompts=[], completions=[" 1"], problem=[problems[0]]) == [float(problems[0].answer == "1")]


SCRIPT = '''
import sys
from pathlib import Path
from mutual_rl.inputs import Inputs

def brevity(completions, **kwargs):
    return [1.0 if len(c) < LIMIT else 0.0 for c in completions]

LIMIT = int(sys.argv[2])
inputs = Inputs([brevity], None, None, None)
(file, data), = inputs.pickled.items()
out = Path(sys.argv[1]) / "inputs" / file  # where a Trainer writes it: under its own run directory
out.parent.mkdir(parents=True)
out.write_bytes(data)
print(out)
'''


def test_one_function_pickled_by_two_runs_is_one_cache_identity_and_another_is_not(dataset_file, tmp_path):
    """A warm start (and a cached evaluation) is keyed by what the function is, not by the run directory its
    pickle lies in: two runs of one script share it; a changed function does not."""
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(SCRIPT)

    def pickled(run: str, limit: int) -> str:
        done = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(tmp_path / run), str(limit)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first, second, other = pickled("run-a", 20), pickled("run-b", 20), pickled("run-c", 30)

    def identity(path: str, success: str):
        cfg = DatasetConfig(path=str(dataset_file), eval_fraction=0.2)
        return make_task(cfg, [f"file:{path}"], success=success).identity

    # where the function decides the success, its bytes key the caches
    assert first != second and identity(first, "brevity") == identity(second, "brevity")
    assert identity(first, "brevity") != identity(other, "brevity")
    # where the answer column's check does (the default), no function changes what is cached: one warm start
    assert identity(first, "auto") == identity(other, "auto") == _task(dataset_file, ["task"]).identity
