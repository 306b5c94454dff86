"""Problems from a dataset as TRL users bring one: ``[task] kind = "dataset"``, read by Hugging Face ``datasets``.

``path`` is a local JSONL/JSON, Parquet or CSV file, or a folder written by ``save_to_disk`` (a ``Dataset``, or
a ``DatasetDict`` whose ``split`` is read). Its ``prompt`` column holds a string (one user turn) or chat turns
(``[{"role": "system", "content": ...}, {"role": "user", "content": ...}]``), formatted by each model's chat
template; ``system_prompt`` adds a system turn to rows without one. Its ``answer`` column is what the task's
verifier checks (strictly by default, as ``kind = "jsonl"`` does); ``answer = ""`` for a dataset with none,
whose reward functions then judge alone (``[reward]``). Every other column reaches the reward functions.

Held out for evaluation, the first that is set: the rows of ``eval_path``, the ``eval_split`` of the
``DatasetDict`` folder, the rows whose ``eval_column`` is true; otherwise a hash of the prompt puts
``eval_fraction`` of the rows aside. The launcher says which, with the sizes, in one line. Nothing is
downloaded: ``datasets`` reads the local files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from tasks.base import Problem, Verdict, is_held_out, register_task
from tasks.jsonl import AnswerJudge, TaskFileError

READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetConfig(msgspec.Struct, tag="dataset", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """Rows of a local file or ``save_to_disk`` folder, read by Hugging Face ``datasets``: a prompt column (a string
    or chat turns), an answer column, and any others, which reach the reward functions (tasks/dataset.py)."""

    path: str  # a .jsonl/.json, .parquet or .csv file, or a save_to_disk folder
    split: str = "train"  # the split read from a DatasetDict folder
    prompt: str = "prompt"  # column: a string, or chat turns [{"role", "content"}, ...]
    answer: str = "answer"  # column the task's verifier checks; "" = none (reward functions judge alone)
    system_prompt: str = ""  # a system turn added to every prompt that has none
    eval_path: str | None = None  # held-out rows from this file or folder (same columns)
    eval_split: str = ""  # held-out rows from this split of the DatasetDict folder at `path`
    eval_column: str = ""  # held-out rows: those whose value in this column is true
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.1  # else a hash split of the prompts
    seed: int = 0  # shuffles the training order
    verify_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # a completion still unjudged then is wrong
    answer_check: Literal["strict", "math_verify"] = "strict"  # as kind = "jsonl"


@register_task("dataset", DatasetConfig)
class DatasetTask:
    """Training rows in a seeded order (problem(id) cycles through them), held-out rows in file order."""

    name = "dataset"

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        rows = self._problems(config.path, config.split, "task.path")
        if config.eval_path is not None:
            train, held = rows, self._problems(config.eval_path, config.split, "task.eval_path")
            how = f"the rows of {config.eval_path}"
        elif config.eval_split:
            train, held = rows, self._problems(config.path, config.eval_split, "task.eval_split")
            how = f"split {config.eval_split!r} of {config.path}"
        elif config.eval_column:
            train = [(r, p) for r, p in rows if not r[config.eval_column]]
            held = [(r, p) for r, p in rows if r[config.eval_column]]
            how = f"the rows of {config.path} whose {config.eval_column!r} is true"
        else:
            train = [(r, p) for r, p in rows if not is_held_out(_prompt_key(r, config.prompt), config.eval_fraction)]
            held = [(r, p) for r, p in rows if is_held_out(_prompt_key(r, config.prompt), config.eval_fraction)]
            how = (f"eval_fraction={config.eval_fraction:g} of {config.path}, by a hash of the prompt; set "
                   "task.eval_path, eval_split or eval_column to choose them")
        self._train, self._eval = [p for _, p in train], [p for _, p in held]
        if not self._train or not self._eval:
            raise TaskFileError(f"{config.path}: {len(self._train)} training and {len(self._eval)} held-out rows; "
                                "both splits need rows (add rows, or change how the held-out ones are chosen)")
        self.split_note = f"task: {len(self._eval):,} held-out problems ({how}), {len(self._train):,} for training"
        self.identity = msgspec.structs.replace(config, path=_digest(train), eval_path=_digest(held))
        self._order = list(range(len(self._train)))
        random.Random(f"dataset:{config.seed}").shuffle(self._order)
        self._judge = AnswerJudge(config.answer_check, config.verify_timeout_s, "dataset")
        self.has_answers = bool(config.answer)  # without an answer column, reward functions judge alone

    def _problems(self, path: str, split: str, key: str) -> list[tuple[dict[str, Any], Problem]]:
        """Each row of a file with its problem, checked: the columns named, each prompt (by its row number)."""
        c = self.config
        rows = read_rows(path, split, key)
        for column, named in ((c.prompt, "task.prompt"), (c.answer, "task.answer"), (c.eval_column, "task.eval_column")):
            if column and column not in rows[0]:
                raise TaskFileError(f"{named} = {column!r}: {path} has no such column (its columns: "
                                    f"{', '.join(rows[0])})")
        return [(row, self._problem_of(row, i, f"{key} row {i}")) for i, row in enumerate(rows)]

    def _problem_of(self, row: dict[str, Any], index: int, where: str) -> Problem:
        c = self.config
        messages = _messages(row[c.prompt], c.system_prompt, f"{where}, column {c.prompt!r}")
        question = messages[-1]["content"] if messages is not None else row[c.prompt]
        answer = "" if not c.answer or row[c.answer] is None else str(row[c.answer])
        columns = {k: v for k, v in row.items() if k not in (c.prompt, c.eval_column)}
        return Problem(prompt_id=index, task=self.name, question=question, answer=answer, messages=messages,
                       columns=columns)

    def problem(self, prompt_id: int) -> Problem:
        found = self._train[self._order[prompt_id % len(self._order)]]
        return msgspec.structs.replace(found, prompt_id=prompt_id)

    def eval_problem(self, index: int) -> Problem:
        return msgspec.structs.replace(self._eval[index % len(self._eval)], prompt_id=index)

    def verify(self, problem: Problem, completion_text: str) -> Verdict:
        if not self.config.answer:  # the config's check refuses "task" as a reward without an answer column
            return Verdict(reward=0.0, verified=False)
        return self._judge(problem.answer, completion_text)

    def worked_solution(self, problem: Problem) -> str:
        return problem.answer


def quiet_datasets() -> None:
    """No progress bars from ``datasets`` (a few hundred rows: they would outnumber a run's own lines), and
    tqdm's lock a thread lock: tqdm makes its bars, and a lock shared across processes, even when they are
    disabled, and in a process forked from the actor server that lock is a named semaphore, which the process
    left behind for multiprocessing to warn of as leaked at the end of the user's script."""
    import datasets
    import tqdm

    datasets.disable_progress_bars()
    if "_lock" not in vars(tqdm.tqdm):
        tqdm.tqdm.set_lock(threading.RLock())


def read_rows(path: str, split: str, key: str) -> list[dict[str, Any]]:
    """The rows of a local dataset file or save_to_disk folder; anything unreadable is one TaskFileError."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing is looked up on the Hub
    try:
        import datasets
    except ImportError:
        raise TaskFileError(f"{key} = {path!r}: reading a dataset needs the datasets package "
                            "(pip install -c constraints.txt -e '.[datasets]')") from None
    quiet_datasets()
    where = Path(path)
    try:
        if where.is_dir():
            found = datasets.load_from_disk(str(where))
            if isinstance(found, datasets.DatasetDict):
                if split not in found:
                    raise TaskFileError(f"{key}: {path} has splits {', '.join(found)}, not {split!r} (task.split)")
                found = found[split]
        elif where.is_file():
            reader = READERS.get(where.suffix.lower())
            if reader is None:
                raise TaskFileError(f"{key} = {path!r}: expected a .jsonl, .json, .parquet or .csv file, or a "
                                    "save_to_disk folder")
            found = datasets.load_dataset(reader, data_files=str(where), split="train")
        else:
            raise TaskFileError(f"{key} = {path!r}: no such file or folder")
    except TaskFileError:
        raise
    except Exception as exc:  # datasets' own errors: a malformed file, a folder that is no dataset
        raise TaskFileError(f"{key} = {path!r}: datasets could not read it ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    rows = found.to_list()
    if not rows:
        raise TaskFileError(f"{key} = {path!r} has no rows")
    return rows


def _messages(prompt: Any, system: str, where: str) -> list[dict[str, str]] | None:
    """A row's prompt as chat turns (None for a plain string without a system prompt), checked."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise TaskFileError(f"{where}: empty prompt")
        return [{"role": "system", "content": system}, {"role": "user", "content": prompt}] if system else None
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise TaskFileError(f"{where}: expected a string or a list of {{\"role\", \"content\"}} turns, found "
                            f"{json.dumps(prompt, default=str)[:80]}")
    if prompt[-1]["role"] != "user":
        raise TaskFileError(f"{where}: the last turn is {prompt[-1]['role']!r}; a prompt ends with the user's turn")
    turns = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if system and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system})
    return turns


def _prompt_key(row: dict[str, Any], column: str) -> str:
    """The text a row's held-out hash is taken of (the same in every process)."""
    value = row.get(column)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _digest(rows: list[tuple[dict[str, Any], Problem]]) -> str:
    """The content of a split's rows, hashed: its warm start and evaluation caches hold wherever the file lies."""
    return hashlib.sha256(msgspec.json.encode([r for r, _ in rows], enc_hook=str)).hexdigest()[:24]
