"""Arithmetic and Countdown: deterministic problems, disjoint held-out sets, exact verifiers."""

from __future__ import annotations

import builtins
import itertools

import msgspec
import pytest

from tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from tasks.base import Problem
from tasks.countdown import CountdownConfig, CountdownTask, check_expression, parse_question, solve
from tasks.registry import TaskConfig, make_task


def _held_out_is_disjoint(task, n: int = 1500) -> None:
    train = {task.problem(i).question for i in range(n)}
    held = {task.eval_problem(i).question for i in range(n)}
    assert len(held) > 50 and not train & held


# --- arithmetic -----------------------------------------------------------------------


def test_arithmetic_problems_are_deterministic_correct_and_split() -> None:
    task = ArithmeticTask(ArithmeticConfig(min_digits=2, max_digits=3, ops=("+", "-", "*"), seed=4))
    again = ArithmeticTask(ArithmeticConfig(min_digits=2, max_digits=3, ops=("+", "-", "*"), seed=4))
    other = ArithmeticTask(ArithmeticConfig(min_digits=2, max_digits=3, ops=("+", "-", "*"), seed=5))
    assert [task.problem(i) for i in range(20)] == [again.problem(i) for i in range(20)]
    assert [task.problem(i) for i in range(20)] != [other.problem(i) for i in range(20)]
    ops = set()
    for i in range(300):
        p = task.problem(i)
        a, op, b = p.question.split()
        ops.add(op)
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert p.answer == str(expected) and expected >= 0
        assert (p.prompt_id, p.task) == (i, "arithmetic")
        assert task.verify(p, task.worked_solution(p)).verified
    assert ops == {"+", "-", "*"}
    _held_out_is_disjoint(task)


def test_arithmetic_verifier_is_exact() -> None:
    task = ArithmeticTask(ArithmeticConfig())
    p = Problem(prompt_id=0, task="arithmetic", question="12 + 34", answer="46")
    for good in ["46", " 46", "46\n", "  046 "]:
        assert task.verify(p, good).verified and task.verify(p, good).reward == 1.0
    for bad in ["47", "", "46.0", "4 6", "46 47", "forty-six", "46!", "-46", "12 + 34"]:
        verdict = task.verify(p, bad)
        assert not verdict.verified and verdict.reward == 0.0, bad


def test_arithmetic_config_errors_name_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match="min_digits"):
        msgspec.convert({"kind": "arithmetic", "min_digits": 3, "max_digits": 2}, TaskConfig)
    with pytest.raises(msgspec.ValidationError, match=r"\$.ops"):
        msgspec.convert({"kind": "arithmetic", "ops": ["/"]}, TaskConfig)
    with pytest.raises(msgspec.ValidationError, match="eval_fraction"):
        msgspec.convert({"kind": "arithmetic", "eval_fraction": 1.5}, TaskConfig)


# --- countdown ------------------------------------------------------------------------

P = Problem(prompt_id=0, task="countdown", question="target 24 numbers 3 4 6 2", answer="24")


def test_countdown_accepts_many_distinct_correct_expressions() -> None:
    task = CountdownTask(CountdownConfig(n_numbers=4))
    correct = [
        "4*6", "6*4", " 4 * 6 ", "((4*6))", "3*(6+2)", "(6+2)*3", "3*(2+6)", "2*3*4", "4*3*2",
        "3*2*4", "4*6/(3-2)", "(3-2)*4*6", "6*4*(3-2)", "6/(3-2)*4", "6*3+2+4", "3*6+4+2",
        "(6*2-4)*3",
    ]
    distinct = set(correct)
    assert len(distinct) == len(correct) == 17
    for expression in distinct:
        assert task.verify(P, expression).verified, expression


def test_countdown_rejects_wrong_reused_foreign_and_ill_formed() -> None:
    task = CountdownTask(CountdownConfig(n_numbers=4))
    wrong_value = ["4*6-2", "3+4+6+2", "6/4*3*2"]
    reused = ["6+6+6+6", "4*4+6+2", "(6*2)*2", "6/2*4*2"]
    foreign = ["24", "12*2", "8*3", "4*6*1"]
    ill_formed = [
        "", "4*", "*4*6", "(4*6", "4*6)", "4 6", "4**6", "4*6=24", "4x6", "4*6.0", "-4*-6",
        "__import__('os').system('true')", "4*6;", "4*6 # comment", "(" * 300 + "4" + ")" * 300,
    ]
    for text in wrong_value + reused + foreign + ill_formed:
        verdict = task.verify(P, text)
        assert not verdict.verified and verdict.reward == 0.0, text
    assert not task.verify(Problem(0, "countdown", "target 5 numbers 3 0 2", "5"), "3/0+2").verified


def test_countdown_verifier_never_calls_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec must not be used")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert check_expression("3*(6+2)", 24, [3, 4, 6, 2])
    assert not check_expression("2**3", 8, [2, 3])  # Python would say 8


def test_countdown_use_all_requires_every_number() -> None:
    assert not check_expression("(6-2)*3*2", 24, [3, 4, 6, 2])  # 2 used twice
    assert check_expression("4*6*(3-2)", 24, [3, 4, 6, 2], use_all=True)
    assert not check_expression("4*6", 24, [3, 4, 6, 2], use_all=True)


def test_countdown_problems_are_solvable_deterministic_and_split() -> None:
    for config in [CountdownConfig(), CountdownConfig(n_numbers=4, max_number=20, max_target=200, use_all=True, seed=3)]:
        task = CountdownTask(config)
        assert [task.problem(i) for i in range(30)] == [CountdownTask(config).problem(i) for i in range(30)]
        for i in range(150):
            p = task.problem(i)
            target, numbers = parse_question(p.question)
            assert p.answer == str(target) and len(numbers) == config.n_numbers
            assert target <= config.max_target and target not in numbers
            solution = task.worked_solution(p)
            assert task.verify(p, solution).verified, (p, solution)
        _held_out_is_disjoint(task, n=800)


def test_solver_finds_the_fewest_numbers_and_reports_the_impossible() -> None:
    assert solve(10, [3, 7, 5]) in {"3+7", "7+3"}
    assert solve(1000, [1, 2, 3]) is None
    for numbers, target in itertools.product([[1, 2, 3], [5, 5, 9]], [4, 9, 14]):
        found = solve(target, numbers)
        assert found is None or check_expression(found, target, numbers)


def test_registry_makes_each_kind_and_refuses_unknown_keys() -> None:
    made = [make_task(msgspec.convert({"kind": k}, TaskConfig)) for k in ("arithmetic", "countdown")]
    assert [t.name for t in made] == ["arithmetic", "countdown"]
    assert isinstance(made[1], CountdownTask) and made[1].config == CountdownConfig()
    with pytest.raises(msgspec.ValidationError, match="unknown field `n_number`"):
        msgspec.convert({"kind": "countdown", "n_number": 4}, TaskConfig)
    with pytest.raises(msgspec.ValidationError, match="kind"):
        msgspec.convert({"kind": "sudoku"}, TaskConfig)


def test_the_task_registry_makes_each_kind_and_refuses_what_it_does_not_know():
    import msgspec

    from tasks.base import register_task
    from tasks.registry import CountdownConfig, make_task, task_names

    assert task_names() == ["arithmetic", "countdown", "dataset", "jsonl", "python", "rg"]
    assert make_task(CountdownConfig()).name == "countdown"

    class OtherConfig(msgspec.Struct, tag="other", tag_field="kind"):
        pass

    with pytest.raises(TypeError, match="registered tasks: arithmetic, countdown, dataset, jsonl, python, rg"):
        make_task(OtherConfig())
    with pytest.raises(ValueError, match="already registered"):
        register_task("countdown", CountdownConfig)(object)
    with pytest.raises(ValueError, match="must be tagged 'mine'"):
        register_task("mine", CountdownConfig)
