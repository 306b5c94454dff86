"""TRL's names carried over: a ``GRPOConfig`` field given as a config key (a section dict, ``--set``, a TOML file)
or as a ``Trainer`` keyword is answered, in one line, with this project's key (or why there is none), through the
real ``Trainer`` constructor and config loader; docs/guides/from-trl.md lists every field of the installed
``GRPOConfig``, as ``engine.config.trl_names`` does."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engine.config import ConfigError, load_run_config
from engine.config.trl_names import TRL_NAMES
from mutual_rl import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
FROM_TRL = ROOT / "docs" / "guides" / "from-trl.md"
REFERENCE = ROOT / "docs" / "reference" / "config.md"


def _refused(**kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        Trainer(SMOKE, **kwargs)
    said = str(err.value)
    assert "\n" not in said, said
    return said


@pytest.mark.parametrize("keyword, value, expected", [
    ("learning_rate", 1e-5, "Trainer(learning_rate=...): not an argument of Trainer; TRL's learning_rate is train.lr "
                            "here (models.N.lr per model): Trainer(..., train={'lr': 1e-05})"),
    ("output_dir", "out", "Trainer(output_dir=...): not an argument of Trainer; TRL's output_dir is run_dir here "
                          "(the run directory: launch.py run --run-dir, Trainer(run_dir=...)): "
                          "Trainer(..., run_dir='out')"),
    ("num_generations", 4, "TRL's num_generations is train.group_size here (G samples per prompt, per model): "
                           "Trainer(..., train={'group_size': 4})"),
    ("beta", 0.04, "TRL's beta is objective.kl_coef here"),
    ("max_completion_length", 256, "TRL's max_completion_length is train.max_new_tokens here"),
    ("per_device_train_batch_size", 4, "TRL's per_device_train_batch_size is train.prompts_per_step here"),
    ("top_p", 0.9, "Trainer(top_p=...): not an argument of Trainer; TRL's top_p is train.top_p here (generators "
                   "only; log-probs are of the truncated distribution; not with sglang): Trainer(..., train={'top_p': "
                   "0.9})"),
    ("min_p", 0.1, "Trainer(min_p=...): not an argument of Trainer; TRL's min_p has no equivalent here: generators "
                   "sample at train.temperature, train.top_p and train.top_k alone"),
])
def test_a_trl_keyword_names_the_key_here(keyword, value, expected):
    assert expected in _refused(**{keyword: value})


def test_args_a_grpo_config_points_to_the_sections():
    trl = pytest.importorskip("trl")
    said = _refused(args=trl.GRPOConfig(output_dir="unused", num_generations=4, bf16=False, use_cpu=True))
    assert said.startswith("Trainer(args=...): not an argument of Trainer; TRL's args is the config here"), said
    assert "Trainer(config, train={'group_size': 8}, objective={'kl_coef': 0.04})" in said, said


@pytest.mark.parametrize("sections, expected", [
    ({"train": {"num_generations": 8}},
     "Trainer(train={'num_generations': 8}): train: unknown field num_generations; "
     "TRL's num_generations is train.group_size here (G samples per prompt, per model)"),
    ({"train": {"learning_rate": 1e-5}}, "train: unknown field learning_rate; TRL's learning_rate is train.lr here"),
    ({"objective": {"beta": 0.1}}, "objective: unknown field beta; TRL's beta is objective.kl_coef here"),
    ({"train": {"per_device_train_batch_size": 4}}, "TRL's per_device_train_batch_size is train.prompts_per_step here"),
    ({"train": {"min_p": 0.1}}, "train: unknown field min_p; TRL's min_p has no equivalent here: generators sample"),
])
def test_a_trl_field_in_a_section_dict_names_the_key_here(sections, expected):
    said = _refused(**sections)
    assert expected in said, said
    assert "did you mean" not in said, said


@pytest.mark.parametrize("override, expected", [
    ("train.num_generations=8", "--set train.num_generations=8: train: unknown field num_generations; "
                                "TRL's num_generations is train.group_size here (G samples per prompt, per model)"),
    ("train.max_completion_length=256", "--set train.max_completion_length=256: train: unknown field "
                                        "max_completion_length; TRL's max_completion_length is train.max_new_tokens "
                                        "here (eval.max_new_tokens for evaluations)"),
    ("beta=0.04", "--set beta=0.04: (top level): unknown field beta; TRL's beta is objective.kl_coef here "
                  "(a k3 KL to the model's starting weights)"),
    ("output_dir=out", "--set output_dir=out: (top level): unknown field output_dir; TRL's output_dir is run_dir "
                       "here (the run directory: launch.py run --run-dir, Trainer(run_dir=...))"),
    ("models.0.learning_rate=1e-5", "--set models.0.learning_rate=1e-5: models.0: unknown field learning_rate; "
                                    "TRL's learning_rate is train.lr here (models.N.lr per model)"),
    ("push_to_hub=true", "--set push_to_hub=true: (top level): unknown field push_to_hub; TRL's push_to_hub has no "
                         "equivalent here: no Hub upload"),
])
def test_a_trl_field_given_with_set_names_the_key_here(override, expected):
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, [override])
    assert str(err.value) == expected


def test_a_trl_field_in_a_toml_file_names_the_key_here(tmp_path):
    path = tmp_path / "trl.toml"
    path.write_text("[train]\nlearning_rate = 1e-6\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value) == f"{path}: train: unknown field learning_rate; TRL's learning_rate is train.lr here " \
                             "(models.N.lr per model)"


def test_other_unknown_names_keep_their_spelling_guess():
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, ["train.stpes=3"])
    assert str(err.value) == "--set train.stpes=3: train: unknown field stpes (did you mean steps?)"
    assert _refused(trian={"steps": 3}) == \
        "Trainer(trian={'steps': 3}): (top level): unknown field trian (did you mean train or run?)"
    assert Trainer(SMOKE, train={"group_size": 4}).config.train.group_size == 4  # this project's key is taken


def test_every_equivalent_is_a_key_of_the_config_reference_and_every_absence_says_why():
    reference = REFERENCE.read_text()
    for name, entry in TRL_NAMES.items():
        if entry.here is None:
            assert entry.note, f"{name}: no equivalent, and no reason given"
            continue
        if "." in entry.here:  # a config key, written as --set writes it (models.N.lr)
            key = entry.here.replace(".N.", "[].")
            assert f"| `{key}` |" in reference, f"{name} -> {entry.here}: not a key of {REFERENCE.name}"
        else:  # a Trainer argument, or the config as a whole
            assert entry.here in ("run_dir", "quiet", "the config"), (name, entry.here)


def _doc_names() -> set[str]:
    """The TRL names in the first column of docs/guides/from-trl.md's table."""
    rows = [line for line in FROM_TRL.read_text().splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z][a-z0-9_]*)", row.split("|")[1])}


def test_the_docs_list_every_grpo_config_field_and_only_trl_names():
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    fields = [f.name for f in dataclasses.fields(trl.GRPOConfig)]
    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    own = [name for name in fields if name not in inherited]
    listed = _doc_names()
    assert not [name for name in own if name not in listed], "GRPOConfig's own fields missing from the docs"
    assert not [name for name in fields if name not in listed], "GRPOConfig's inherited fields missing from the docs"
    assert not [name for name in fields if name not in TRL_NAMES], "GRPOConfig fields the errors do not answer"
    assert listed == set(TRL_NAMES), (sorted(listed - set(TRL_NAMES)), sorted(set(TRL_NAMES) - listed))
