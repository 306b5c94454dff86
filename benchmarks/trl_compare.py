"""This project's solo GRPO against TRL's GRPOTrainer, on one setup, scored by one evaluator.

The setup is a run config's first model, task and ``[train]`` settings (``configs/smollm2.toml``:
SmolLM2-135M-Instruct on reasoning-gym's chain_sum). Both systems start from the same weights and
tokenizer, see the same prompts in the model's chat template, are paid by the project's own verifier
(``task.verify``: 1 for an exact answer), draw ``group_size`` samples a prompt and ``prompts_per_step``
prompts a step at the same temperature and completion length, and take AdamW steps at the model's learning
rate with the same betas, gradient clip, clip range (0.2, 0.28), token-mean loss and no KL. Then each final
model is scored by ``engine.prep.evaluation.held_out_accuracy`` on the same held-out problems, greedily.

Two budgets: ``--minutes M`` (default: the config's ``run.max_minutes``) gives each system the same
wall-clock time to train (this project: its RL phase; TRL: ``trainer.train()``), ``--steps N`` the same
number of optimizer steps, which separates speed from what a step learns. TRL runs in one process with
torch's threads on every core (its best setting here); this project with its config's ``[pool]``.

Per system it prints steps, samples, samples/s, CPU-seconds per sample (the processes' user + system time
over the training phase), peak memory (summed RSS and PSS of the processes, sampled every second), the
held-out accuracy before and after with standard errors, and the mean training reward; then
``gain_ratio`` (this project's gain in points over TRL's) and ``samples_per_s_ratio``. TRL comes with
the ``[compare]`` extra (``pip install -c constraints.txt -e '.[compare]'``).

    python -m benchmarks.trl_compare [--config configs/smollm2.toml] [--minutes 15 | --steps 50] [--seed 0]
                                     [--set KEY=VALUE ...] [--only project|trl] [--model NAME]
                                     [--out results/trl_compare/NAME.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
PSS_EVERY = 5  # samples between PSS readings
CLIP = (0.2, 0.28)  # the project's GRPO defaults (eps_low, eps_high): TRL's epsilon, epsilon_high


def missing_trl() -> str | None:
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return ("the TRL side needs trl and datasets, which are not installed: "
                "pip install -c constraints.txt -e '.[compare]'")
    return None


def solo_tree(config: Path, seed: int, minutes: float | None, steps: int | None, overrides: list[str] = (),
              model: str | None = None) -> dict:
    """The config's first model (or ``model``) alone under solo GRPO, with the budget asked for, no live evals
    (TRL has none)."""
    from engine.config import ConfigError
    from engine.config.load import apply_override, parse_override

    tree = tomllib.loads(config.read_text())
    for text in overrides:
        apply_override(tree, *parse_override(text), text)
    names = [m.get("name") for m in tree["models"]]
    if model is not None and model not in names:
        raise ConfigError(f"--model {model}: {config} has no such model (it has {', '.join(map(str, names))})")
    tree["models"] = [tree["models"][names.index(model) if model is not None else 0]]
    objective = {k: v for k, v in tree.get("objective", {}).items() if k in ("kl_coef",)}
    tree["objective"] = {"kind": "grpo", **objective}
    run, train, ev = tree.setdefault("run", {}), tree.setdefault("train", {}), tree.setdefault("eval", {})
    run.update(seed=seed, report=False, tensorboard=False)
    ev["every_steps"] = 0
    if steps is not None:
        train["steps"], run["max_minutes"] = steps, 24 * 60.0
    elif minutes is not None:
        run["max_minutes"] = minutes
    return tree


class TreeSampler:
    """Peak summed RSS/PSS of a process and its descendants, and their CPU time, sampled every second (PSS, which
    reads every mapping of every process, every PSS_EVERY samples: it costs the measured processes' CPU)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = 0
        self.cpu: list[tuple[float, float]] = []  # (unix time, CPU-seconds so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            rss = pss = 0
            cpu = 0.0
            full = len(self.cpu) % PSS_EVERY == 0
            for p in procs:
                try:
                    mem = p.memory_full_info() if full else p.memory_info()
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                rss, pss = rss + mem.rss, pss + getattr(mem, "pss", 0)
                cpu += t.user + t.system + t.children_user + t.children_system
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.cpu.append((time.time(), cpu))
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_between(self, start: float, end: float) -> float:
        """CPU-seconds the tree used between two unix times (the samples nearest inside them)."""
        inside = [c for t, c in self.cpu if start <= t <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else float("nan")


def run_project(tree: dict, workdir: Path) -> dict:
    config = workdir / "project.toml"
    config.write_text(tomli_w.dumps(tree))
    run_dir = workdir / "project-run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "run", "--config", str(config), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    sampler = TreeSampler(proc.pid)
    code = proc.wait()
    sampler.stop()
    if code != 0:
        raise SystemExit(f"trl_compare: this project's run failed (exit code {code}); its output is above")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    model = tree["models"][0]["name"]
    mine = [r for r in records if r.get("model") == model]
    final = next(r for r in mine if r.get("event") == "final")
    steps = [r for r in mine if r.get("event") == "step"]
    start = min(r["time"] for r in mine if r.get("event") == "start")
    end = max(r["time"] for r in steps)
    samples = int(final["own_experiences"])
    rl_s = end - start
    return dict(steps=int(final["step"]), samples=samples, train_s=round(rl_s, 1),
                samples_per_s=samples / rl_s, cpu_s_per_sample=sampler.cpu_between(start, end) / samples,
                peak_rss_gib=sampler.peak_rss / 2**30, peak_pss_gib=sampler.peak_pss / 2**30,
                acc_before=final["warm_accuracy"], se_before=final["warm_accuracy_stderr"],
                acc_after=final["accuracy"], se_after=final["accuracy_stderr"], eval_n=final["eval_n"],
                reward_mean=_mean([r.get("reward_mean") for r in steps]),
                truncated_frac=_mean([r.get("truncated_frac") for r in steps]), run_dir=str(run_dir))


def run_trl(tree: dict, workdir: Path) -> dict:
    config = workdir / "trl.toml"
    config.write_text(tomli_w.dumps(tree))
    out = workdir / "trl-result.json"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.trl_compare", "--trl-child", str(config), str(out)],
                            cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    sampler = TreeSampler(proc.pid)
    code = proc.wait()
    sampler.stop()
    if code != 0 or not out.exists():
        raise SystemExit(f"trl_compare: the TRL run failed (exit code {code}); its output is above")
    result = json.loads(out.read_text())
    start, end = result.pop("train_start"), result.pop("train_end")
    result["cpu_s_per_sample"] = sampler.cpu_between(start, end) / result["samples"]
    result.update(peak_rss_gib=sampler.peak_rss / 2**30, peak_pss_gib=sampler.peak_pss / 2**30)
    return result


def trl_child(config_path: str, out_path: str) -> int:
    """TRL's GRPOTrainer on the config's first model; writes its figures to ``out_path`` (a separate process)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine.config import load_run_config, model_spec, tokenizer_cache
    from engine.prep.evaluation import held_out_accuracy
    from policies.models import build_policy
    from tasks.registry import make_task
    from tasks.rewards import TaskReward
    from tokenbridge import load_tokenizer

    cfg = load_run_config(config_path)
    m, t = cfg.models[0], cfg.train
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.run.seed)
    spec = model_spec(m)
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    model = build_policy(spec, tokenizer)
    task = make_task(cfg.task)
    evaluate = lambda label: held_out_accuracy(model, tokenizer, spec.arch, task, cfg.eval.num_problems,  # noqa: E731
                                               cfg.eval, t.max_new_tokens, label=label)
    before = evaluate(f"{m.name} before TRL (held-out)")
    steps = t.steps if cfg.run.max_minutes >= 24 * 60 else 100_000
    n_prompts = min(steps, 5_000) * t.prompts_per_step
    rows = [{"prompt": [{"role": "user", "content": task.problem(i).question}], "prompt_id": i}
            for i in range(n_prompts)]
    reward = TaskReward(task)  # the task's verifier in TRL's shape: the same function the project's runs call

    budget_s = cfg.run.max_minutes * 60

    class WallClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            if time.time() - self.t0 >= budget_s:
                control.should_training_stop = True
            return control

    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"), use_cpu=True, seed=cfg.run.seed, report_to=[],
        save_strategy="no", logging_steps=1, max_steps=steps, per_device_train_batch_size=t.prompts_per_step * t.group_size,
        gradient_accumulation_steps=1, num_generations=t.group_size, learning_rate=m.lr or t.lr,
        lr_scheduler_type="constant", warmup_steps=t.warmup_steps, adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1], weight_decay=0.0, max_grad_norm=t.grad_clip, max_completion_length=t.max_new_tokens,
        temperature=t.temperature, beta=cfg.objective.kl_coef, epsilon=CLIP[0], epsilon_high=CLIP[1],
        loss_type="dapo", scale_rewards="group", disable_dropout=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[WallClock()])
    started, cpu0 = time.time(), time.process_time()
    trainer.train()
    ended = time.time()
    model = trainer.model
    after = evaluate(f"{m.name} after TRL (held-out)")
    logs = [r for r in trainer.state.log_history if "reward" in r]
    done = trainer.state.global_step
    samples = done * t.prompts_per_step * t.group_size
    result = dict(steps=done, samples=samples, train_s=round(ended - started, 1), samples_per_s=samples / (ended - started),
                  process_cpu_s=time.process_time() - cpu0, train_start=started, train_end=ended,
                  acc_before=before.accuracy, se_before=before.stderr, acc_after=after.accuracy, se_after=after.stderr,
                  eval_n=after.n, reward_mean=_mean([r["reward"] for r in logs]),
                  truncated_frac=_mean([r.get("completions/clipped_ratio") for r in logs]))
    Path(out_path).write_text(json.dumps(result))
    return 0


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def gain(side: dict) -> None:
    """Adds the held-out gain in points and in standard errors of the difference."""
    side["gain_pts"] = 100 * (side["acc_after"] - side["acc_before"])
    se = math.hypot(side["se_before"], side["se_after"])
    side["gain_se"] = (side["acc_after"] - side["acc_before"]) / se if se > 0 else None


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+local-changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trl_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.toml")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="equal wall-clock training time (default: run.max_minutes)")
    budget.add_argument("--steps", type=int, help="equal optimizer steps instead of equal time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("project", "trl"), help="run one side only")
    ap.add_argument("--model", help="the config's model to train (default: its first); TRL's side needs one "
                                    "with a checkpoint")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--out", type=Path, help="also write the JSON here (results/trl_compare/NAME.json)")
    ap.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_child:
        return trl_child(*args.trl_child)
    from engine.config import ConfigError

    if args.only != "project" and (problem := missing_trl()):
        print(f"trl_compare: {problem}", file=sys.stderr)
        return 2
    if not args.config.is_file():
        print(f"trl_compare: no config file {args.config}", file=sys.stderr)
        return 2
    try:
        tree = solo_tree(args.config, args.seed, args.minutes, args.steps, args.set, args.model)
        if args.only != "project" and "checkpoint" not in tree["models"][0]:
            raise ConfigError(f"--model {tree['models'][0]['name']}: built from scratch (its warm start is this "
                              "project's), so TRL has no weights to start it from; add --only project")
    except ConfigError as exc:
        print(f"trl_compare: {exc}", file=sys.stderr)
        return 2
    config = args.config.resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
    result: dict = dict(benchmark="trl_compare", commit=git_commit(), config=str(shown), seed=args.seed,
                        budget=f"{args.steps} steps" if args.steps else f"{tree['run']['max_minutes']} minutes",
                        model=tree["models"][0]["name"], cores=os.cpu_count())
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as tmp:
        for side, run in (("project", run_project), ("trl", run_trl)):
            if args.only in (None, side):
                print(f"trl_compare: {side} ...", file=sys.stderr, flush=True)
                result[side] = run(tree, Path(tmp))
                gain(result[side])
                result[side].pop("run_dir", None)
    if "project" in result and "trl" in result:
        p, t = result["project"], result["trl"]
        result["gain_ratio"] = p["gain_pts"] / t["gain_pts"] if t["gain_pts"] > 0 else None
        result["samples_per_s_ratio"] = p["samples_per_s"] / t["samples_per_s"]
    line = json.dumps(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
