"""benchmarks.trl_compare's setup: what each side trains is the config's first model alone under solo GRPO, with
the budget asked for; TRL's arguments (float32, no checkpointing, the project's prompt order and step), its prompts
(the project's token ids), the float32 scorer of saved weights and the seeds' summary (the runs themselves take half
an hour: docs/benchmarks.md has their figures)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli_w

from benchmarks.trl_compare import solo_tree
from benchmarks.trl_seeds import interval, summary, t975
from benchmarks.trl_side import trl_args, trl_prompt
from tests.realtok import load_test_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "configs" / "smollm2.toml"
SMOKE = ROOT / "configs" / "smoke.toml"


def test_both_sides_train_the_configs_first_model_alone_with_one_budget():
    base = tomllib.loads(SMOLLM2.read_text())
    timed = solo_tree(SMOLLM2, seed=2, minutes=None, steps=None)
    assert [m["name"] for m in timed["models"]] == [base["models"][0]["name"]]
    assert timed["objective"] == {"kind": "grpo"} and timed["run"]["seed"] == 2
    assert timed["run"]["max_minutes"] == base["run"]["max_minutes"] and timed["eval"]["every_steps"] == 0
    assert timed["train"] == base["train"] and timed["task"] == base["task"]  # the setup itself is untouched
    assert timed["timeouts"] == base["timeouts"]  # a solo SmolLM2's first step outlasts the default peer_silent_s
    stepped = solo_tree(SMOLLM2, seed=0, minutes=None, steps=27, overrides=["models.0.lr=2e-5", "eval.num_problems=50"])
    assert stepped["train"]["steps"] == 27 and stepped["run"]["max_minutes"] >= 24 * 60  # steps, not the clock
    assert stepped["models"][0]["lr"] == 2e-5 and stepped["eval"]["num_problems"] == 50
    peer = solo_tree(SMOLLM2, seed=0, minutes=None, steps=400, overrides=["train.lr=3e-4"], model="llama")
    assert [m["name"] for m in peer["models"]] == ["llama"] and peer["train"]["lr"] == 3e-4  # the small peer alone


def test_a_bad_override_is_one_line():
    done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--only", "project", "--set", "train"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "expected KEY=VALUE" in done.stderr


def _config(tree: dict, path: Path):
    """The run config TRL's child reads, from the tree written as the benchmark writes it (not checked against
    this machine: SmolLM2's GGUF is not converted for a test)."""
    from engine.config import config_from_tree
    from engine.config.load import read_tree

    path.write_text(tomli_w.dumps(tree))
    return config_from_tree(*read_tree(path), check_machine=False, quiet=True)


def test_trl_trains_in_float32_without_checkpointing_on_the_projects_step(tmp_path):
    trl = pytest.importorskip("trl", reason="TRL's side needs the [compare] extra (trl)")
    cfg = _config(solo_tree(SMOLLM2, seed=3, minutes=None, steps=27), tmp_path / "run.toml")
    args = trl.GRPOConfig(**trl_args(cfg, tmp_path / "out"))
    assert (args.bf16, args.fp16, args.torch_compile) == (False, False, False)
    assert args.gradient_checkpointing is False and getattr(args, "activation_checkpointing", False) is False
    assert args.shuffle_dataset is False and args.use_cpu and args.seed == 3 and args.max_steps == 27
    # one generation of 4 prompts x 8 samples per optimizer step, trained on once
    assert (args.per_device_train_batch_size, args.num_generations, args.generation_batch_size) == (32, 8, 32)
    assert (args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps) == (1, 1, 1)
    # plain sampling at the config's temperature and length
    assert (args.temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty) == (1.0, 1.0, 0, None, 1.0)
    assert args.max_completion_length == 48 and not args.use_vllm and not args.mask_truncated_completions
    # SmolLM2's learning rate, the project's AdamW and objective
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.max_grad_norm) == (1e-5, 0.9, 0.99, 1.0)
    assert args.optim == "adamw_torch_fused" and args.weight_decay == 0.0 and args.lr_scheduler_type == "constant"
    assert (args.epsilon, args.epsilon_high, args.beta, args.loss_type, args.scale_rewards) == (
        0.2, 0.28, 0.0, "dapo", "group")
    timed = _config(solo_tree(SMOLLM2, seed=0, minutes=2.0, steps=None, overrides=["objective.aggregation=seq_mean",
                                                                                    "objective.std_normalise=false"]),
                    tmp_path / "timed.toml")
    timed_args = trl_args(timed, tmp_path / "out")
    assert timed_args["max_steps"] >= 10_000  # the clock stops it
    assert (timed_args["loss_type"], timed_args["scale_rewards"]) == ("grpo", "none")


def test_trl_walks_the_prompts_in_the_order_the_projects_dispatcher_hands_them_out(tmp_path):
    trl = pytest.importorskip("trl", reason="TRL's side needs the [compare] extra (trl)")
    from trl import GRPOTrainer

    from engine.schedule.dispatch import Dispatch
    from tasks.registry import make_task

    cfg = _config(solo_tree(SMOLLM2, seed=5, minutes=None, steps=3), tmp_path / "run.toml")
    args = trl.GRPOConfig(**trl_args(cfg, tmp_path / "out"))
    rows = list(range(12))  # rows 0..11 are training problems 0..11 (trl_rows)
    # GRPOTrainer's own sampler method, on the attributes its __init__ copies from the config
    trainer = SimpleNamespace(args=args, num_generations=args.num_generations, num_iterations=args.num_iterations,
                              shuffle_dataset=args.shuffle_dataset, train_dataset=rows)
    order = list(GRPOTrainer._get_train_sampler(trainer, rows))
    task = make_task(cfg.task)
    dispatch = Dispatch(cfg, task)
    per_step = args.per_device_train_batch_size
    for step in range(3):
        drawn = order[step * per_step:(step + 1) * per_step]
        assert drawn == [i for i in range(step * 4, step * 4 + 4) for _ in range(8)]
        assert [task.problem(i).question for i in drawn[::8]] == [p.question for p in dispatch.problems(step)]


def test_trls_prompt_is_the_text_the_project_renders_for_a_model_without_a_chat_template(tmp_path):
    from policies.templates import PromptFormat, format_prompt, prompt_ids

    gpt2, mistral, gemma = (load_test_tokenizer(n, tmp_path / "tok") for n in ("gpt2", "mistral", "gemma3"))
    question = "What is 3 + 4?"
    shots = PromptFormat("gemma3_text", "Q: What is 1 + 1?\nA: 2\n\nQ: {question}\nA:", "newline")
    for tok, fmt, bos_in_text, text in (
            (gpt2, "gpt2", "", format_prompt("gpt2", question)),  # GPT-2's template has no BOS
            (mistral, "llama", "", format_prompt("llama", question)),  # the tokenizer adds <s> itself, as the project
            (gemma, "gemma3_text", "", format_prompt("gemma3_text", question)),  # Gemma 3 base: plain Q/A, own <bos>
            (gemma, shots, "", shots.template.format(question=question)),  # a base model's own prompt
            (gpt2, "gemma3_text", "<|endoftext|>", format_prompt("gemma3_text", question))):  # a BOS family whose
        row = trl_prompt(tok, fmt, question)                                   # tokenizer adds none: written in
        assert row == bos_in_text + text
        assert tok(text=row)["input_ids"] == prompt_ids(tok, fmt, question)  # what TRL tokenizes for a text row
    system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    assert trl_prompt(gpt2, "gpt2", system) == format_prompt("gpt2", "Answer briefly.\n\nWhat is 3 + 4?")


def test_a_tokenizer_with_a_chat_template_gets_chat_turns_that_tokenize_as_the_projects(tmp_path):
    from policies.templates import PromptFormat, prompt_ids

    tok = load_test_tokenizer("gpt2", tmp_path / "tok")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    row = trl_prompt(tok, "gpt2", "What is 3 + 4?")
    assert row == [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tok.apply_chat_template([row], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    assert list(ids) == prompt_ids(tok, "gpt2", "What is 3 + 4?")
    own = PromptFormat("gpt2", "Solve: {question}")  # a model's own prompt is the user turn's text
    assert trl_prompt(tok, own, "What is 3 + 4?") == [{"role": "user", "content": "Solve: What is 3 + 4?"}]


def test_saved_weights_are_scored_in_float32_as_the_model_in_memory_scores(tmp_path):
    import torch

    from engine.config import load_run_config, model_spec, tokenizer_cache
    from engine.prep.evaluation import held_out_accuracy
    from policies.models import build_policy, save_policy
    from tasks.registry import make_task
    from tokenbridge import load_tokenizer

    tree = solo_tree(SMOKE, seed=0, minutes=None, steps=1, overrides=["eval.num_problems=6"], model="gpt2")
    tree["run"]["cache_dir"] = str(tmp_path / "cache")
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tree))
    cfg = load_run_config(path)
    spec = model_spec(cfg.models[0])
    tok = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    model = build_policy(spec, tok, seed=1)
    in_memory = held_out_accuracy(model, tok, spec.arch, make_task(cfg.task), 6, cfg.eval, cfg.eval_max_new_tokens)
    save_policy(model, tok, tmp_path / "float32")
    save_policy(model.to(torch.bfloat16), tok, tmp_path / "bf16")
    for saved in ("float32", "bf16"):
        out = tmp_path / f"{saved}.json"
        done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--score-child", str(path),
                               str(tmp_path / saved), "test", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr  # the scorer refuses to evaluate in anything but float32
        score = json.loads(out.read_text())
        assert score["n"] == 6
    assert json.loads((tmp_path / "float32.json").read_text())["accuracy"] == in_memory.accuracy


def test_the_summary_is_each_figures_mean_with_its_95_percent_t_interval():
    mid = interval([1.0, 2.0, 3.0])
    assert mid["n"] == 3 and mid["mean"] == 2.0 and mid["hi"] - 2.0 == pytest.approx(4.303 / math.sqrt(3))
    assert interval([5.0, None]) == dict(n=1, mean=5.0, lo=None, hi=None)  # a ratio TRL's zero gain left out
    assert t975(11) == pytest.approx(2.201, abs=2e-3) and t975(30) == pytest.approx(2.042, abs=1e-3)
    assert t975(10) > t975(11) > t975(60) > 1.96
    seeds = [{"project": {"gain_pts": g}, "trl": {"gain_pts": 2.0}, "gain_ratio": g / 2.0, "samples_per_s_ratio": 2.0,
              "pss_ratio": 1.5} for g in (4.0, 6.0)]
    made = summary(seeds)
    assert made["project_gain_pts"]["mean"] == 5.0 and made["gain_ratio"]["mean"] == 2.5
    assert made["samples_per_s_ratio"] == dict(n=2, mean=2.0, lo=2.0, hi=2.0)


@pytest.mark.parametrize("flags, said", [(["--seeds", "0,x"], "--seeds 0,x: expected distinct whole numbers"),
                                         (["--trl-threads", "0"], "--trl-threads 0: must be at least 1")])
def test_a_bad_seed_list_or_thread_count_is_one_line(flags, said):
    done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert said in done.stderr


def test_seeds_run_apart_combine_into_one_summary_and_other_setups_are_refused(tmp_path):
    head = {"benchmark": "trl_compare", "commit": "abc1234", "config": "configs/smollm2.toml", "budget": "15.0 minutes",
            "model": "smollm2", "cores": 2, "trl_threads": 2}
    for seed, gain in ((0, 4.0), (1, 6.0)):
        (tmp_path / f"s{seed}.json").write_text(json.dumps({**head, "seed": seed, "project": {"gain_pts": gain},
                                                            "trl": {"gain_pts": 2.0}, "samples_per_s_ratio": 2.5}))
    out = tmp_path / "all.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--combine", str(tmp_path / "s1.json"),
                           str(tmp_path / "s0.json"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    made = json.loads(out.read_text())
    assert [r["seed"] for r in made["seeds"]] == [0, 1] and made["commit"] == "abc1234"
    assert made["summary"]["project_gain_pts"]["mean"] == 5.0 and made["summary"]["samples_per_s_ratio"]["n"] == 2
    (tmp_path / "s2.json").write_text(json.dumps({**head, "commit": "def5678", "seed": 2}))
    done = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--combine", str(tmp_path / "s0.json"),
                           str(tmp_path / "s2.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "seed 2 has commit 'def5678' where seed 0 has 'abc1234'" in done.stderr
