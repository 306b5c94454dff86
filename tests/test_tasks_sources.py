"""Tasks beside the built-in ones: reasoning-gym's datasets (tasks.gym), your own Python (tasks.user), and answers
read from worded completions (tasks.answers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import load_run_config
from tasks.answers import read_answer
from tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from tasks.base import Verdict
from tasks.gym import GymConfig, GymTask
from tasks.registry import make_task
from tasks.user import PythonConfig

CONFIG = """
[task]
{task}
[objective]
kind = "grpo"
[[models]]
name = "a"
arch = "gpt2"
tokenizer = "gpt2"
[pool]
workers = 2
"""
TWO_TERM_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"]}


@pytest.mark.parametrize("rule, text, read", [
    ("exact", " 46 ", "46"), ("exact", "  ", None),
    ("last_number", "17 + 25 = 42.", "42"), ("last_number", "It is 1,234 apples.", "1234"),
    ("last_number", "-3.5 or so", "-3.5"), ("last_number", "no idea", None),
    ("answer_line", "We add.\nAnswer: 42.", "42"), ("answer_line", "answer: 1\nANSWER:  7 ", "7"),
    ("answer_line", "The answer is 42", None), ("answer_line", "Answer:", None),
])
def test_each_answer_rule_reads_what_its_documentation_says(rule, text, read):
    assert read_answer(rule, text) == read


def test_arithmetic_in_words_keeps_its_split_and_reads_the_last_number():
    bare, worded = ArithmeticTask(ArithmeticConfig()), ArithmeticTask(ArithmeticConfig(
        wording="What is {expr}? Answer with the number only.", answer="last_number"))
    for i in range(50):  # the same problems, in other words: the split is by the expression
        assert worded.problem(i).question == f"What is {bare.problem(i).question}? Answer with the number only."
        assert worded.eval_problem(i).answer == bare.eval_problem(i).answer
    p = worded.problem(0)
    assert worded.verify(p, f"{p.question[8:-32]} = {p.answer}.").verified
    assert not bare.verify(p, f"{p.question[8:-32]} = {p.answer}.").verified  # "exact" wants the bare number
    assert not worded.verify(p, f"{int(p.answer) + 1}").verified
    with pytest.raises(ValueError, match="must hold {expr} once"):
        ArithmeticConfig(wording="What is it?")


def test_a_reasoning_gym_dataset_passes_its_options_and_holds_out_questions_it_never_trains_on(tmp_path):
    path = tmp_path / "rg.toml"
    path.write_text(CONFIG.format(task='kind = "rg:basic_arithmetic"\noptions = '
                                  '{min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 2, operators = ["+"]}'))
    cfg = load_run_config(path)
    assert cfg.task == GymConfig(dataset="basic_arithmetic", options=TWO_TERM_SUMS)
    task = make_task(cfg.task)
    train = [task.problem(i) for i in range(2000)]
    held_out = [task.eval_problem(i) for i in range(500)]
    assert {p.question for p in train}.isdisjoint(p.question for p in held_out)
    assert len({p.question for p in held_out}) == 500  # distinct
    for p in train[:300] + held_out[:300]:  # the options: two terms of 1-2 digits, one "+", nothing else
        expression = p.question.removeprefix("Calculate ").removesuffix(".")
        assert expression.count("+") == 1 and not re.search(r"[*/]|\d\s+-|\d{3}", expression), p.question
        assert eval(expression) == int(p.answer), p  # noqa: S307 (reasoning-gym's own arithmetic, checked)
    p = held_out[7]
    assert task.verify(p, f"The sum is {p.answer}.") == Verdict(reward=1.0, verified=True)  # the dataset's scorer
    assert not task.verify(p, f"The sum is {int(p.answer) + 1}.").verified
    fresh = make_task(cfg.task)  # another process: a problem it has not drawn yet is judged all the same
    assert fresh.verify(train[1500], train[1500].answer).verified
    assert make_task(cfg.task).problem(1234) == train[1234]  # the same problems in every process


def test_a_worked_solution_in_words_is_what_the_task_itself_judges_right():
    """The warm start's target and sgt_ref's reference follow the task's ``solution`` template."""
    gym = GymTask(GymConfig(dataset="chain_sum", solution="The answer is {answer}."))
    arith = ArithmeticTask(ArithmeticConfig(answer="answer_line", solution="We add.\nAnswer: {answer}"))
    for task in (gym, arith):
        p = task.problem(3)
        assert task.worked_solution(p).endswith((f"The answer is {p.answer}.", f"Answer: {p.answer}"))
        assert task.verify(p, task.worked_solution(p)).verified
    assert ArithmeticTask(ArithmeticConfig()).worked_solution(p) == p.answer  # bare by default
    for template, rule, message in (("The answer is {answer}.", "exact", "does not read back"),
                                    ("The answer is {x}.", "last_number", "must hold {answer} once"),
                                    ("Answer: {answer} of {answer}", "answer_line", "must hold {answer} once")):
        with pytest.raises(ValueError, match=message):
            ArithmeticConfig(answer=rule, solution=template)


def test_a_reasoning_gym_reward_is_the_exact_answer_unless_partial_credit_is_asked_for():
    """chain_sum's scorer pays 0.5 for "-15" when the answer is -5: GRPO on SmolLM2 drifted to such answers."""
    exact, partial = (GymTask(GymConfig(dataset="chain_sum", options={"min_digits": 1, "max_digits": 1},
                                        partial_credit=credit)) for credit in (False, True))
    p = next(q for q in map(exact.problem, range(100)) if len(q.answer.lstrip("-")) == 1)
    near = f"The answer is {p.answer}5."  # the answer inside a longer number
    assert exact.verify(p, near) == Verdict(reward=0.0, verified=False)
    assert 0.0 < partial.verify(p, near).reward < 1.0 and not partial.verify(p, near).verified
    for task in (exact, partial):
        assert task.verify(p, f"The answer is {p.answer}.") == Verdict(reward=1.0, verified=True)


@pytest.mark.parametrize("config, message", [
    (GymConfig(dataset="no_such_dataset"), r"reasoning-gym has no dataset 'no_such_dataset'"),
    (GymConfig(dataset="basic_arithmetic", options={"no_such_option": 1}), r"refused options"),
])
def test_a_reasoning_gym_dataset_it_cannot_make_is_one_line(config, message):
    with pytest.raises(ValueError, match=message) as err:
        GymTask(config)
    assert "\n" not in str(err.value)


USER_TASK = '''
from tasks.base import Problem

class Parity:
    name = "parity"
    def problem(self, i):
        return Problem(prompt_id=i, task="parity", question=f"Is {2 * i + 1} odd?", answer="yes")
    def eval_problem(self, i):
        return Problem(prompt_id=i, task="parity", question=f"Is {2 * i} odd?", answer="no")
    def verify(self, problem, text):
        return float(text.strip().lower().startswith(problem.answer))

def make(scale=1):
    return Parity()

def broken():
    return object()
'''


def test_a_python_task_is_made_by_your_factory_from_the_launch_directory(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # removed again after the test, with the module
    path = tmp_path / "py.toml"
    path.write_text(CONFIG.format(task='kind = "python"\nfactory = "my_tasks:make"\noptions = {scale = 2}'))
    task = make_task(load_run_config(path).task)
    assert task.name == "parity" and task.problem(3).question == "Is 7 odd?"
    assert task.verify(task.problem(3), " Yes, it is") == Verdict(reward=1.0, verified=True)
    assert task.verify(task.eval_problem(3), "yes") == Verdict(reward=0.0, verified=False)
    assert task.worked_solution(task.problem(0)) == "yes"
    for factory, options, message in (("my_tasks:broken", {}, "has no problem\\(\\) method"),
                                      ("my_tasks:absent", {}, "my_tasks has no function 'absent'"),
                                      ("no_module_here:make", {}, "cannot import 'no_module_here'"),
                                      ("my_tasks", {}, 'expected "module:function"'),
                                      ("my_tasks:make", {"nope": 1}, "refused options")):
        with pytest.raises(ValueError, match=message):
            make_task(PythonConfig(factory=factory, options=options))
    assert Path(task.__class__.__module__.replace(".", "/") + ".py").name == "user.py"
