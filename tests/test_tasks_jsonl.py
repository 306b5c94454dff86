"""JSONL tasks: loading, disjoint splits, math-verify answers, one clear error per bad file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tasks.jsonl import JsonlConfig, JsonlTask, TaskFileError
from tasks.registry import make_task


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _dataset(tmp_path: Path, n: int = 60) -> Path:
    lines = [f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}", "id": {i}}}' for i in range(n)]
    lines.insert(5, "")  # blank lines are allowed
    lines.append('{"prompt": "Half of one?", "answer": "\\\\frac{1}{2}"}')
    lines.append('{"prompt": "Numeric answer", "answer": 7}')
    return _write(tmp_path / "data.jsonl", lines)


def test_loads_splits_and_orders_deterministically(tmp_path: Path) -> None:
    config = JsonlConfig(path=str(_dataset(tmp_path)), seed=1)
    task = make_task(config)
    assert isinstance(task, JsonlTask) and task.name == "jsonl"
    train = [task.problem(i) for i in range(200)]
    held = [task.eval_problem(i) for i in range(200)]
    assert {p.question for p in train}.isdisjoint({p.question for p in held})
    assert len({p.question for p in train}) + len({p.question for p in held}) == 62
    assert train == [JsonlTask(config).problem(i) for i in range(200)]
    assert [p.question for p in train[:20]] != [JsonlTask(JsonlConfig(path=config.path, seed=2)).problem(i).question for i in range(20)]
    assert train[7].prompt_id == 7 and train[7].task == "jsonl"


def test_eval_path_gives_the_held_out_set(tmp_path: Path) -> None:
    held = _write(tmp_path / "eval.jsonl", ['{"prompt": "2+2?", "answer": "4"}'])
    task = JsonlTask(JsonlConfig(path=str(_dataset(tmp_path)), eval_path=str(held)))
    assert task.eval_problem(3).question == "2+2?"


def test_math_answers_are_checked_up_to_equivalence(tmp_path: Path) -> None:
    task = JsonlTask(JsonlConfig(path=str(_dataset(tmp_path))))
    everything = [task.problem(i) for i in range(62)] + [task.eval_problem(i) for i in range(62)]
    half = next(p for p in everything if p.question == "Half of one?")
    for good in [" 1/2", " 0.5", " \\frac{1}{2}", " The answer is \\boxed{\\frac12}."]:
        assert task.verify(half, good).verified, good
    for bad in [" 1/3", " 2", "", " no idea"]:
        assert not task.verify(half, bad).verified, bad
    problem = task.problem(0)
    assert task.verify(problem, task.worked_solution(problem)).verified


def test_verify_works_off_the_main_thread(tmp_path: Path) -> None:
    task = JsonlTask(JsonlConfig(path=str(_dataset(tmp_path))))
    problem = task.problem(3)
    results: list[bool] = []
    worker = threading.Thread(target=lambda: results.append(task.verify(problem, " " + problem.answer).verified))
    worker.start()
    worker.join()
    assert results == [True]


def test_a_completion_crafted_to_be_slow_cannot_hang_verification(tmp_path: Path, capfd) -> None:
    """9^{9^{9^{9}}} makes math-verify compute a huge power (one C call, past its own time-outs):
    judged wrong within the deadline, in a thread as in the engine, counted, and the next check works."""
    import time

    task = JsonlTask(JsonlConfig(path=str(_dataset(tmp_path)), verify_timeout_s=2.0))
    everything = [task.problem(i) for i in range(62)] + [task.eval_problem(i) for i in range(62)]
    # an expression's check asks math-verify (a number's never does)
    problem = next(p for p in everything if p.question == "Half of one?")
    task.verify(problem, problem.answer)  # the verifier process is up
    verdicts: list = []
    started = time.monotonic()
    worker = threading.Thread(target=lambda: verdicts.append(task.verify(problem, "$9^{9^{9^{9}}}$")))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "verification hung"
    assert time.monotonic() - started < 10
    assert verdicts[0].reward == 0.0 and verdicts[0].timed_out and task._judge._verifier.timeouts == 1
    assert task.verify(problem, " " + problem.answer).verified  # a fresh verifier serves the next one
    err = capfd.readouterr().err
    assert err.count("took over 2s to verify") == 1 and "Timeout is disabled" not in err


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "x", "answer": "1"', "invalid JSON"),
        ('["x", "1"]', "Expected `object`"),
        ('{"prompt": "x"}', "missing required field `answer`"),
        ('{"prompt": 3, "answer": "1"}', r"\$.prompt"),
        ('{"prompt": "  ", "answer": "1"}', "empty prompt"),
    ],
)
def test_malformed_line_is_one_error_naming_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", ['{"prompt": "1+1?", "answer": "2"}', "", bad_line])
    with pytest.raises(TaskFileError, match=rf"{path}, line 3: .*{message}") as caught:
        make_task(JsonlConfig(path=str(path)))
    assert "\n" not in str(caught.value)


def test_missing_or_empty_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=f"task file {tmp_path / 'nope.jsonl'} does not exist"):
        JsonlTask(JsonlConfig(path=str(tmp_path / "nope.jsonl")))
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(TaskFileError, match="has no problems"):
        JsonlTask(JsonlConfig(path=str(empty)))
    one = _write(tmp_path / "one.jsonl", ['{"prompt": "1+1?", "answer": "2"}'])
    with pytest.raises(TaskFileError, match="empty train or held-out split"):
        JsonlTask(JsonlConfig(path=str(one)))


def test_the_parent_deadline_kills_a_check_that_outlives_it() -> None:
    """A deadline shorter than math-verify's own (1 s) time-out: the parent gives up first, kills the child,
    and the next check starts a fresh one."""
    from tasks.bounded import BoundedVerifier

    verifier = BoundedVerifier(deadline_s=0.5)
    assert verifier.check("$4$", "$2+2$") is True
    child = verifier._proc
    assert verifier.check("$4$", "$9^{9^{9^{9}}}$") is None and verifier.timeouts == 1
    assert not child.is_alive() and verifier._proc is None
    assert verifier.check("$4$", "$5$") is False
    verifier.close()


ACCEPTED = ["2", " 2", "The answer is 2.", "1 + 1 = 2", "\\boxed{2}", "So it is \\boxed{2}.", "Answer: 2",
            "answer: 2.", "**2**", "x = 2$", "Half of four is 2.", "2 apples"]
REFUSED = [
    " 2цу04))\r", "2 apples))",  # trailing junk
    "2abc99", "2abc", "abc2",  # digits glued to letters
    "\\boxed{2} or \\boxed{3}", "Answer: 2\nAnswer: 3", "2, 3",  # several candidate answers
    "Half of four is 2!", "1 + 1", "3 or 2",  # a factorial, an expression, two candidates (issue 58)
    "２", "٢", "2️⃣",  # unicode digits
    "12", "20", "2.5", "The answer is 123",  # the answer inside a longer number
    "", "no idea", "\\boxed{2",
]


def test_the_default_answer_check_is_strict_on_adversarial_completions(tmp_path: Path) -> None:
    """Real training samples math-verify paid for (" 2цу04))\\r" for the answer 2) and a table of their kind: the
    strict check reads one answer where an answer stands; math_verify (the option) is shown paying for them."""
    data = _write(tmp_path / "d.jsonl", ['{"prompt": "1 + 1?", "answer": "2"}', '{"prompt": "Big?", "answer": "1234"}'])
    strict = JsonlTask(JsonlConfig(path=str(data), eval_path=str(data)))
    two, big = strict.eval_problem(0), strict.eval_problem(1)
    assert [t for t in ACCEPTED if not strict.verify(two, t).verified] == []
    assert [t for t in REFUSED if strict.verify(two, t).verified] == []
    assert strict.verify(big, "It is 1,234.").verified and not strict.verify(big, "11234").verified
    lenient = JsonlTask(JsonlConfig(path=str(data), eval_path=str(data), answer_check="math_verify"))
    assert lenient.verify(two, " 2цу04))\r").verified and lenient.verify(two, "2abc99").verified


def test_a_file_with_a_utf8_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?", "answer": 4}\n'.encode())
    task = JsonlTask(JsonlConfig(path=str(path), eval_path=str(path)))
    assert [task.eval_problem(i).question for i in range(2)] == ["1 + 1?", "2 + 2?"]
