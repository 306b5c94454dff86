"""``[task] kind = "dataset"``: local files and save_to_disk folders read by Hugging Face ``datasets``, prompts as
strings or chat turns (a system prompt added), the held-out split chosen four ways and said in one line, the
other columns carried to the reward functions, and each bad file one TaskFileError naming it."""

from __future__ import annotations

import copy
import json

import datasets
import pytest

from policies.templates import prompt_ids
from tasks.dataset import DatasetConfig, DatasetTask
from tasks.jsonl import TaskFileError
from test_models_fixtures import real_tokenizer
from tinygguf import CHAT_TEMPLATE

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i),
         "budget": 10 + i % 3, "test": i % 5 == 0} for i in range(1, 101)]


def _flat(rows):
    return [{"prompt": r["messages"][0]["content"], "solution": r["solution"], "budget": r["budget"]} for r in rows]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "folder"])
def test_each_format_reads_the_same_problems(tmp_path, fmt):
    ds = datasets.Dataset.from_list(_flat(ROWS))
    path = tmp_path / (f"rows.{fmt}" if fmt != "folder" else "rows")
    {"jsonl": lambda: ds.to_json(str(path)), "parquet": lambda: ds.to_parquet(str(path)),
     "csv": lambda: ds.to_csv(str(path), index=False), "folder": lambda: ds.save_to_disk(str(path))}[fmt]()
    task = DatasetTask(DatasetConfig(path=str(path), answer="solution", eval_fraction=0.2))
    held = [task.eval_problem(i) for i in range(len(task._eval))]
    assert 8 <= len(held) <= 35 and task.split_note.startswith(f"task: {len(held)} held-out problems (eval_fraction")
    p = task.problem(0)
    assert p.messages is None and p.prompt == p.question and p.question.startswith("What is")
    assert p.answer == str(2 * int(p.question.split()[2])) and p.columns["budget"] in (10, 11, 12)
    assert not {q.question for q in held} & {task.problem(i).question for i in range(len(task._train))}


def test_chat_prompts_get_the_system_prompt_and_each_models_template(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "rows"))
    task = DatasetTask(DatasetConfig(path=str(tmp_path / "rows"), prompt="messages", answer="solution",
                                     system_prompt="Answer with the number.", eval_column="test"))
    assert task.split_note == (f"task: 20 held-out problems (the rows of {tmp_path / 'rows'} whose 'test' is true), "
                               "80 for training")
    p = task.eval_problem(0)
    assert p.messages == [{"role": "system", "content": "Answer with the number."},
                          {"role": "user", "content": "What is 5 + 5?"}]
    assert p.question == "What is 5 + 5?" and p.answer == "10" and set(p.columns) == {"solution", "budget"}
    templated = copy.copy(real_tokenizer("gpt2"))
    templated.chat_template = CHAT_TEMPLATE
    assert templated.decode(prompt_ids(templated, "gpt2", p.prompt)) == (
        "<|im_start|>system\nAnswer with the number.<|im_end|>\n<|im_start|>user\nWhat is 5 + 5?<|im_end|>\n"
        "<|im_start|>assistant\n")
    plain = real_tokenizer("gpt2")  # no chat template: the turns, a blank line apart, in the family's Q/A
    assert plain.decode(prompt_ids(plain, "gpt2", p.prompt)) == "Q: Answer with the number.\n\nWhat is 5 + 5?\nA:"


def test_a_dataset_dict_gives_its_named_splits(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(_flat(ROWS[:70])),
                                   "test": datasets.Dataset.from_list(_flat(ROWS[70:]))})
    splits.save_to_disk(str(tmp_path / "dd"))
    task = DatasetTask(DatasetConfig(path=str(tmp_path / "dd"), answer="solution", eval_split="test"))
    assert len(task._train) == 70 and len(task._eval) == 30 and task.eval_problem(0).question == "What is 71 + 71?"
    assert "split 'test' of" in task.split_note
    with pytest.raises(TaskFileError, match=r"has splits train, test, not 'validation' \(task.split\)"):
        DatasetTask(DatasetConfig(path=str(tmp_path / "dd"), answer="solution", eval_split="validation"))


@pytest.mark.parametrize("rows, config, said", [
    (_flat(ROWS), {"answer": "answer"}, "task.answer = 'answer': {path} has no such column (its columns: prompt, "
                                        "solution, budget)"),
    (_flat(ROWS), {"prompt": "question"}, "task.prompt = 'question': {path} has no such column"),
    ([{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "1"}] * 20,
     {}, "task.path row 0, column 'prompt': the last turn is 'assistant'; a prompt ends with the user's turn"),
    ([{"prompt": [{"text": "hi"}], "answer": "1"}] * 20, {},
     "task.path row 0, column 'prompt': expected a string or a list of {{\"role\", \"content\"}} turns"),
    ([{"prompt": " ", "answer": "1"}] * 20, {}, "task.path row 0, column 'prompt': empty prompt"),
])
def test_a_bad_dataset_is_one_line_naming_the_column_or_row(tmp_path, rows, config, said):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(TaskFileError) as err:
        DatasetTask(DatasetConfig(path=str(path), eval_fraction=0.5, **config))
    assert said.format(path=path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name, content, said", [
    ("rows.txt", "x", "task.path = '{path}': expected a .jsonl, .json, .parquet or .csv file, or a save_to_disk folder"),
    ("missing.jsonl", None, "task.path = '{path}': no such file or folder"),
    ("broken.jsonl", '{"prompt": "a", ', "task.path = '{path}': datasets could not read it"),
])
def test_an_unreadable_path_is_one_line(tmp_path, name, content, said):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(TaskFileError) as err:
        DatasetTask(DatasetConfig(path=str(path)))
    assert str(err.value).startswith(said.format(path=path)) and "\n" not in str(err.value)
