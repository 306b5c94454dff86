"""Held-out sets: n eval problems are n different questions, never seen in training."""

import pytest

from tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def test_arithmetic_eval_problems_are_distinct_and_held_out():
    task = ArithmeticTask(ArithmeticConfig(min_digits=1, max_digits=2, eval_fraction=0.2))
    questions = [task.eval_problem(i).question for i in range(1000)]
    assert len(set(questions)) == 1000
    train = {task.problem(i).question for i in range(5000)}
    assert not train & set(questions)
    assert task.eval_problem(17) == ArithmeticTask(task.config).eval_problem(17)  # deterministic


def test_operands_are_uniform_over_values_not_digit_counts():
    task = ArithmeticTask(ArithmeticConfig(min_digits=1, max_digits=2))
    one_digit = sum(len(task.problem(i).question.split(" + ")[0]) == 1 for i in range(4000))
    assert one_digit / 4000 < 0.2  # 10 of 100 values; uniform over digit counts would give ~0.5


def test_asking_for_more_distinct_problems_than_exist_is_a_clear_error():
    task = ArithmeticTask(ArithmeticConfig(min_digits=1, max_digits=1, eval_fraction=0.1))
    with pytest.raises(ValueError, match="distinct held-out questions"):
        task.eval_problem(50)
