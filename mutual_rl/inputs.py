"""What a ``Trainer`` is handed as Python objects, turned into files a run's processes read: reward functions
(pickled with cloudpickle, so that one defined in a script or a notebook cell reaches the generator processes)
and datasets (``save_to_disk`` folders). They go to ``RUN_DIR/inputs/``, and the config names them there
(``reward.funcs = ["file:..."]``, ``task.path``), so a resumed run reads the same ones.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from engine.config import ConfigError

PENDING = "<run_dir>"  # where the config points before the run directory exists


class Inputs:
    """The Python objects of one Trainer, checked when it is made and written when it trains."""

    def __init__(self, reward_funcs: Any, reward_weights: Any, train_dataset: Any, eval_dataset: Any,
                 reward_nan: Any = None, success: Any = None) -> None:
        funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        self.pickled: dict[str, bytes] = {}  # file name -> a reward function, pickled
        self.funcs: list[str] = [self._spec(i, f) for i, f in enumerate(funcs)]
        # the functions as given, by their reward.funcs entry: checked by a dry call before anything is pickled
        self.callables = {spec: f for spec, f in zip(self.funcs, funcs) if not isinstance(f, str)}
        self.weights = None if reward_weights is None else [_weight(i, w) for i, w in enumerate(reward_weights)]
        self.nan = reward_nan  # reward.nan, checked with the config
        self.success = success  # reward.success; a function is one more reward function, weighed 0: it judges only
        if callable(success):
            self.success_spec = self._spec(len(funcs), success)
            self.callables[self.success_spec] = success
        self.datasets = {name: _dataset(name, ds) for name, ds in
                         (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)) if ds is not None}
        if "eval_dataset" in self.datasets and "train_dataset" not in self.datasets:
            raise ConfigError("Trainer(eval_dataset=...): needs a train_dataset too (or a task of the config's)")

    def _spec(self, i: int, func: Any) -> str:
        """A ``reward.funcs`` entry: a string as given, a function pickled (by value where it was defined in
        ``__main__``: a script or a notebook; by reference to its module otherwise)."""
        if isinstance(func, str):
            return func
        if not callable(func):
            raise ConfigError(f"Trainer(reward_funcs=...): entry {i} is {func!r} ({type(func).__name__}), not a function or "
                              'a name ("task", "exact_answer", "module:function")')
        import cloudpickle

        name = re.sub(r"[^A-Za-z0-9_]+", "_", getattr(func, "__name__", type(func).__name__))
        try:
            data = cloudpickle.dumps(func)
        except Exception as exc:  # a closure over something that cannot be pickled (a lock, an open socket)
            raise ConfigError(f"Trainer(reward_funcs=...): {name} cannot be sent to the generator processes "
                              f"({type(exc).__name__}: {exc}); define what it needs inside it, or load it lazily"
                              ) from None
        file = f"reward-{i}-{name}.pkl"
        self.pickled[file] = data
        return f"file:{PENDING}/inputs/{file}"

    def apply(self, tree: dict[str, Any], sections: dict[str, Any]) -> list[tuple[list[str], str]]:
        """Name the inputs in a config tree (before it is checked): the reward section, the dataset task. Returns
        the keys set, each with the argument that set it (what an error about the key names)."""
        said: list[tuple[list[str], str]] = []
        if self.funcs or self.weights is not None or self.nan is not None or self.success is not None:
            reward = dict(tree.get("reward") or {})
            if self.funcs:
                reward["funcs"] = self.funcs
                said.append((["reward", "funcs"], "Trainer(reward_funcs=...)"))
            if self.weights is not None:
                reward["weights"] = self.weights
                said.append((["reward", "weights"], f"Trainer(reward_weights={self.weights})"))
            if self.nan is not None:
                reward["nan"] = self.nan
                said.append((["reward", "nan"], f"Trainer(reward_nan={self.nan!r})"))
            if callable(self.success):  # judged by a function of its own that pays nothing
                from tasks.rewards import reward_name

                funcs = list(reward.get("funcs") or ["task"])
                weights = list(reward.get("weights") or [1.0] * len(funcs))
                reward.update(funcs=[*funcs, self.success_spec], weights=[*weights, 0.0],
                              success=reward_name(self.success))
                said.append((["reward", "success"], "Trainer(success=...)"))
            elif self.success is not None:
                reward["success"] = self.success
                said.append((["reward", "success"], f"Trainer(success={self.success!r})"))
            tree["reward"] = reward
        if "train_dataset" not in self.datasets:
            return said
        said.append((["task"], "Trainer(train_dataset=...)"))
        given = sections.get("task") if isinstance(sections.get("task"), dict) else {}
        if given.get("kind", "dataset") != "dataset":
            raise ConfigError(f"Trainer(train_dataset=...): the task is the dataset, but task={given!r} names kind "
                              f"{given['kind']!r}; leave kind out")
        own = tree.get("task") if isinstance(tree.get("task"), dict) else {}
        task = {**(own if own.get("kind") == "dataset" else {}), **given, "kind": "dataset",
                "path": f"{PENDING}/inputs/train_dataset"}
        if "eval_dataset" in self.datasets:
            task["eval_path"] = f"{PENDING}/inputs/eval_dataset"
        tree["task"] = task
        columns = self.datasets["train_dataset"].column_names
        for key, default in (("prompt", "prompt"), ("answer", "answer")):
            column = task.get(key, default)
            if column and column not in columns:
                none = "; task={'answer': ''} for a dataset without answers" if key == "answer" else ""
                raise ConfigError(f"Trainer(train_dataset=...): task.{key} = {column!r} is not one of its columns "
                                  f"({', '.join(columns)}){none}")
        return said

    def write(self, run_dir: Path) -> None:
        """The pickled functions and the datasets, into ``run_dir/inputs``."""
        folder = run_dir / "inputs"
        folder.mkdir(parents=True, exist_ok=True)
        for file, data in self.pickled.items():
            (folder / file).write_bytes(data)
        if self.datasets:
            from tasks.dataset import quiet_datasets

            quiet_datasets()
        for name, ds in self.datasets.items():
            ds.save_to_disk(str(folder / name))

    @property
    def any(self) -> bool:
        return bool(self.pickled or self.datasets)

    def written(self, cfg, run_dir: Path):
        """``cfg`` once the inputs are written into ``run_dir``: its paths name them there."""
        import msgspec

        from engine.config import Origin, config_from_tree

        self.write(run_dir)
        return config_from_tree(resolved(msgspec.to_builtins(cfg), run_dir), Origin("Trainer()"), quiet=True)


def resolved(tree: Any, run_dir: Path) -> Any:
    """A config tree whose paths into the pending run directory name ``run_dir``."""
    if isinstance(tree, str):
        return tree.replace(PENDING, str(run_dir))
    if isinstance(tree, dict):
        return {k: resolved(v, run_dir) for k, v in tree.items()}
    if isinstance(tree, list):
        return [resolved(v, run_dir) for v in tree]
    return tree


def _weight(i: int, w: Any) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ConfigError(f"Trainer(reward_weights=...): entry {i} is {w!r}, not a number")
    return float(w)


def _dataset(name: str, ds: Any):
    """A ``datasets.Dataset`` (a list of row dicts becomes one)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"Trainer({name}=...): needs the datasets package "
                          "(pip install -c constraints.txt -e '.[datasets]')") from None
    if isinstance(ds, list) and not ds:
        raise ConfigError(f"Trainer({name}=...): the list has no rows")
    if isinstance(ds, list) and all(isinstance(r, dict) for r in ds):
        return datasets.Dataset.from_list(ds)
    if isinstance(ds, list):
        kind = next(type(r).__name__ for r in ds if not isinstance(r, dict))
        raise ConfigError(f"Trainer({name}=...): a list of rows must hold dicts (column -> value); it holds a {kind}")
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(f"Trainer({name}=...): a DatasetDict ({', '.join(ds)}); pass one split, e.g. "
                          f"ds[{next(iter(ds))!r}]")
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(f"Trainer({name}=...): expected a datasets.Dataset or a list of row dicts, got "
                          f"{type(ds).__name__}")
    if len(ds) == 0:
        raise ConfigError(f"Trainer({name}=...): the dataset has no rows")
    return ds


def remove_inputs(run_dir: Path) -> None:
    """What ``write`` put in a run directory that then did not run (a config refused): the directory too when that
    leaves it empty (``make_run_dir`` made it, or it was empty before)."""
    shutil.rmtree(run_dir / "inputs", ignore_errors=True)
    try:
        run_dir.rmdir()
    except OSError:
        pass  # not empty: it held something before
