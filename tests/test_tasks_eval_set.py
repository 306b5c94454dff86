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


def _jsonl(path, n: int):
    path.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(n)))
    return path


def test_a_small_held_out_set_is_scored_once_each_and_the_split_is_said(tmp_path):
    """A JSONL file's hash split keeps a few lines for evaluation: they are scored once each (n is what exists,
    and the standard error is over them), not cycled up to eval.num_problems, and the task says how many."""
    import math

    from engine.prep.evaluation import evaluate, held_out_problems
    from policies.backend import HFBackend
    from policies.models import build_policy
    from tasks.jsonl import JsonlConfig, JsonlTask
    from test_models_fixtures import pad_id, real_tokenizer, tiny_spec

    task = JsonlTask(JsonlConfig(path=str(_jsonl(tmp_path / "t.jsonl", 32))))
    held_out = held_out_problems(task, 1000)
    assert 0 < len(held_out) < 32 and len({p.question for p in held_out}) == len(held_out)
    assert task.split_note.startswith(f"task: {len(held_out)} of the 32 problems in ")

    class FirstOnly(JsonlTask):  # a real task whose verifier accepts the first held-out question only
        def verify(self, problem, completion_text):
            return super().verify(problem, problem.answer if problem.question == held_out[0].question else "x")

    tokenizer = real_tokenizer("gpt2")
    backend = HFBackend(build_policy(tiny_spec("gpt2"), tokenizer), tokenizer.eos_token_id, pad_id(tokenizer))
    result = evaluate(backend, tokenizer, "gpt2", FirstOnly(task.config), num_problems=1000, max_new_tokens=2)
    n = len(held_out)
    assert (result.n, result.accuracy) == (n, 1 / n)
    assert result.stderr == math.sqrt((1 / n) * (1 - 1 / n) / n)
    assert JsonlTask(JsonlConfig(path=task.config.path, eval_path=task.config.path)).split_note is None
