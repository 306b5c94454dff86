"""This project's solo GRPO against TRL's GRPOTrainer, on one setup, both final models scored by one evaluator.

The setup is a run config's first model (or ``--model``), task and ``[train]`` settings (``configs/smollm2.toml``:
SmolLM2-135M-Instruct on reasoning-gym's chain_sum), under each side's plain GRPO:

- this project: ``launch.py run`` of the config with that model alone, ``[objective]`` kind grpo (the config's
  clip range, normalisation, aggregation and kl_coef kept), no live evaluations, no periodic checkpoints (TRL
  saves none), its ``[pool]`` of worker processes and ``run.mode`` (async by default: generators may run a step
  or two ahead, their samples importance-weighted).
- TRL 1.16: ``benchmarks.trl_side`` in one process with ``--trl-threads`` torch threads: GRPOTrainer in float32
  without gradient checkpointing (TRL's defaults are bf16 autocast and checkpointing), strictly on-policy, on the
  same prompts in the same order (unshuffled rows: step k trains on problems kQ .. kQ+Q-1, as the project's
  dispatcher hands them out), rendered to the same token ids; ``trl_side``'s docstring lists every setting.

Both start from the same weights and tokenizer, are paid the project's reward (the task's verifier: 1 for an exact
answer), draw ``group_size`` samples a prompt and ``prompts_per_step`` prompts a step at the same temperature and
completion length, and take fused-AdamW steps at the model's learning rate with the same betas and gradient clip.
Each saves its final model; then one scorer, a fresh process per model, loads each from disk in float32
(``policies.models.build_policy`` of the saved directory) and runs ``engine.prep.evaluation.held_out_accuracy`` on
the same held-out problems, greedily: "before" is each side's starting checkpoint (TRL's: the config's; this
project's: its warm start, with ``warmstart_steps = 0`` a float32 copy of the same weights, so the same figure),
scored once for all seeds, "after" each side's final model. (The project's own in-run final evaluation is kept as
``acc_after_in_run``: the same figure, unless thread counts tip a greedy tie.)

Two budgets: ``--minutes M`` (default: the config's ``run.max_minutes``) gives each system the same wall-clock
time to train (this project: its RL phase; TRL: ``trainer.train()``), ``--steps N`` the same number of optimizer
steps, which separates speed from what a step learns. ``--seeds 0,1,2`` runs both sides on each seed in turn;
``--combine A.json B.json ...`` joins seeds run apart (one commit, one setup: checked) into that same JSON.

Per system it prints steps, samples, samples/s, CPU-seconds per sample (the processes' user + system time over the
training phase), peak memory (summed RSS and PSS of the processes, sampled every second), the held-out accuracy
before and after with standard errors, and the mean training reward; then ``gain_ratio`` (this project's gain in
points over TRL's), ``samples_per_s_ratio`` and ``pss_ratio`` (this project's peak PSS over TRL's). With several
seeds the JSON holds each seed's result in ``seeds`` and, in ``summary``, the mean of each side's gain and of each
ratio with its 95% Student-t interval over the seeds. TRL comes with the ``[compare]`` extra
(``pip install -c constraints.txt -e '.[compare]'``).

TRL's torch threads: ``--trl-threads N`` (default: every core, as the earlier runs; recorded as ``trl_threads``). To
pick N, run ``--only trl --steps 3 --set eval.num_problems=1 --trl-threads N`` for each N on an otherwise idle
machine and keep the N with the highest ``trl.samples_per_s``.

    python -m benchmarks.trl_compare [--config configs/smollm2.toml] [--minutes 15 | --steps 50]
                                     [--seed 0 | --seeds 0,1,2] [--set KEY=VALUE ...] [--only project|trl]
                                     [--model NAME] [--trl-threads N] [--out results/trl_compare/NAME.json]
    python -m benchmarks.trl_compare --combine SEED0.json SEED1.json ... [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from benchmarks import emit, git_commit
from benchmarks.trl_seeds import combine, mean_of, summary

import tomli_w

from benchmarks.trl_side import missing_trl
from exchange.records import read_records

ROOT = Path(__file__).resolve().parents[1]
PSS_EVERY = 5  # samples between PSS readings
# the objective fields plain GRPO shares with the config's objective (policies.objective_config.SurrogateConfig)
SURROGATE = ("eps_low", "eps_high", "behav_weight_cap", "max_staleness", "std_normalise", "adv_eps", "aggregation",
             "kl_coef")
# Student t's 0.975 quantile by degrees of freedom; above the table, its Cornish-Fisher expansion (1e-3 at 11)


def solo_tree(config: Path, seed: int, minutes: float | None, steps: int | None, overrides: list[str] = (),
              model: str | None = None) -> dict:
    """The config's first model (or ``model``) alone under solo GRPO, with the budget asked for, no live evals
    (TRL has none) and a checkpoint only at the end (TRL saves only its final model, outside its timed phase)."""
    from engine.config import ConfigError
    from engine.config.load import apply_override, parse_override

    tree = tomllib.loads(config.read_text())
    for text in overrides:
        apply_override(tree, *parse_override(text), text)
    names = [m.get("name") for m in tree["models"]]
    if model is not None and model not in names:
        raise ConfigError(f"--model {model}: {config} has no such model (it has {', '.join(map(str, names))})")
    tree["models"] = [tree["models"][names.index(model) if model is not None else 0]]
    objective = {k: v for k, v in tree.get("objective", {}).items() if k in SURROGATE}
    tree["objective"] = {"kind": "grpo", **objective}
    run, train, ev = tree.setdefault("run", {}), tree.setdefault("train", {}), tree.setdefault("eval", {})
    run.update(seed=seed, report=False, tensorboard=False, checkpoint_every=0)
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


def _run(argv: list[str], what: str, out: Path | None = None) -> TreeSampler:
    """Runs a training child (its output on stderr), sampling its process tree; a failure is one line
    (SystemExit)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    sampler = TreeSampler(proc.pid)
    code = proc.wait()
    sampler.stop()
    if code != 0 or (out is not None and not out.exists()):
        raise SystemExit(f"trl_compare: {what} failed (exit code {code}); its output is above")
    return sampler


def run_project(config: Path, workdir: Path) -> dict:
    run_dir = workdir / "project-run"
    sampler = _run([sys.executable, str(ROOT / "launch.py"), "run", "--config", str(config), "--run-dir",
                    str(run_dir)], "this project's run")
    records = read_records(run_dir).records
    model = tomllib.loads(config.read_text())["models"][0]["name"]
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
                acc_after_in_run=final["accuracy"], reward_mean=mean_of([r.get("reward_mean") for r in steps]),
                truncated_frac=mean_of([r.get("truncated_frac") for r in steps]),
                start_checkpoint=final["warm_checkpoint"], final_checkpoint=final["checkpoint"])


def run_trl(config: Path, workdir: Path, threads: int) -> dict:
    out = workdir / "trl-result.json"
    sampler = _run([sys.executable, "-m", "benchmarks.trl_side", str(config), str(out), str(workdir / "trl-final"),
                    "--threads", str(threads)], "the TRL run", out)
    result = json.loads(out.read_text())
    start, end = result.pop("train_start"), result.pop("train_end")
    result["cpu_s_per_sample"] = sampler.cpu_between(start, end) / result["samples"]
    result.update(peak_rss_gib=sampler.peak_rss / 2**30, peak_pss_gib=sampler.peak_pss / 2**30)
    return result


class Scorer:
    """Held-out accuracy of saved models, each loaded in float32 in a fresh process by ``score_child``; a
    checkpoint is scored once (a side's starting one is its "before" on every seed)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.done = workdir, {}

    def __call__(self, config: Path, checkpoint: str, label: str) -> dict:
        key = os.path.realpath(checkpoint)
        if key not in self.done:
            out = self.workdir / f"score-{len(self.done)}.json"
            code = subprocess.run([sys.executable, "-m", "benchmarks.trl_compare", "--score-child", str(config),
                                   checkpoint, label, str(out)], cwd=ROOT, stdout=sys.stderr).returncode
            if code != 0 or not out.exists():
                raise SystemExit(f"trl_compare: scoring {checkpoint} failed (exit code {code}); its output is above")
            self.done[key] = json.loads(out.read_text())
        return self.done[key]


def score_child(config_path: str, checkpoint: str, label: str, out_path: str) -> int:
    """The config's first model with the weights of ``checkpoint`` (a save_pretrained directory), float32, scored
    by ``held_out_accuracy`` with the config's ``[eval]`` settings; writes the result to ``out_path``."""
    import torch

    from engine.config import load_run_config, model_spec, tokenizer_cache
    from engine.prep.evaluation import held_out_accuracy
    from policies.models import build_policy
    from policies.templates import prompt_format
    from engine.config import run_task
    from tokenbridge import load_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_run_config(config_path)
    spec = model_spec(cfg.models[0], checkpoint=checkpoint)
    tokenizer = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    model = build_policy(spec, tokenizer)  # load_policy: float32, whatever the saved dtype
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the scorer evaluates in float32"
    task = run_task(cfg)  # as this project's evaluations
    res = held_out_accuracy(model, tokenizer, prompt_format(spec), task, cfg.eval.num_problems, cfg.eval,
                            cfg.eval_max_new_tokens, label=label)
    Path(out_path).write_text(json.dumps(dict(accuracy=res.accuracy, stderr=res.stderr, n=res.n,
                                              truncated=res.truncated)))
    return 0


def scored(side: dict, name: str, config: Path, scorer: Scorer, model: str) -> None:
    """Adds the side's held-out accuracy before (its starting checkpoint) and after (its final model), and its gain
    in points and in standard errors of the difference."""
    before = scorer(config, side.pop("start_checkpoint"), f"{model} before {name} (float32, from disk)")
    after = scorer(config, side.pop("final_checkpoint"), f"{model} after {name} (float32, from disk)")
    side.update(acc_before=before["accuracy"], se_before=before["stderr"], acc_after=after["accuracy"],
                se_after=after["stderr"], eval_n=after["n"], eval_truncated=after["truncated"])
    side["gain_pts"] = 100 * (side["acc_after"] - side["acc_before"])
    se = math.hypot(side["se_before"], side["se_after"])
    side["gain_se"] = (side["acc_after"] - side["acc_before"]) / se if se > 0 else None


def run_seed(tree: dict, workdir: Path, only: str | None, threads: int, scorer: Scorer) -> dict:
    """Both sides (or ``only`` one) on one seed's tree, trained, then scored."""
    workdir.mkdir(parents=True)
    config = workdir / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    result: dict = {}
    for side, train in (("project", lambda: run_project(config, workdir)),
                        ("trl", lambda: run_trl(config, workdir, threads))):
        if only in (None, side):
            print(f"trl_compare: seed {tree['run']['seed']}, {side} ...", file=sys.stderr, flush=True)
            result[side] = train()
    model = tree["models"][0]["name"]
    for side in result:
        scored(result[side], side, config, scorer, model)
    shutil.rmtree(workdir)  # the final models (this project's with its AdamW state: ~1.6 GB for SmolLM2) are scored
    if "project" in result and "trl" in result:
        p, t = result["project"], result["trl"]
        result["gain_ratio"] = p["gain_pts"] / t["gain_pts"] if t["gain_pts"] > 0 else None
        result["samples_per_s_ratio"] = p["samples_per_s"] / t["samples_per_s"]
        result["pss_ratio"] = p["peak_pss_gib"] / t["peak_pss_gib"] if t["peak_pss_gib"] > 0 else None
    return result


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2`` as a list; anything else is a ConfigError."""
    from engine.config import ConfigError

    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text}: expected distinct whole numbers separated by commas, e.g. 0,1,2")
    return seeds


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trl_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.toml")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="equal wall-clock training time (default: run.max_minutes)")
    budget.add_argument("--steps", type=int, help="equal optimizer steps instead of equal time")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0)
    seeds.add_argument("--seeds", help="several seeds in turn, e.g. 0,1,2: each seed's result and "
                                                       "the mean of each figure with its 95%% interval")
    ap.add_argument("--only", choices=("project", "trl"), help="run one side only")
    ap.add_argument("--model", help="the config's model to train (default: its first); TRL's side needs one "
                                    "with a checkpoint")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, metavar="N",
                    help="torch threads of TRL's process (default: every core)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--out", type=Path, help="also write the JSON here (results/trl_compare/NAME.json)")
    ap.add_argument("--combine", nargs="+", type=Path, metavar="JSON",
                    help="no run: the results of seeds run apart (one commit, one setup) as one, with the summary")
    ap.add_argument("--score-child", nargs=4, help=argparse.SUPPRESS)
    return ap


def trees(args) -> list[dict]:
    """One solo tree per seed; a config problem is a ConfigError."""
    from engine.config import ConfigError

    if args.trl_threads < 1:
        raise ConfigError(f"--trl-threads {args.trl_threads}: must be at least 1")
    seeds = seed_list(args.seeds) if args.seeds is not None else [args.seed]
    made = [solo_tree(args.config, seed, args.minutes, args.steps, args.set, args.model) for seed in seeds]
    if args.only != "project" and "checkpoint" not in made[0]["models"][0]:
        raise ConfigError(f"--model {made[0]['models'][0]['name']}: built from scratch (its warm start is this "
                          "project's), so TRL has no weights to start it from; add --only project")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.score_child:
        return score_child(*args.score_child)
    from engine.config import ConfigError

    if args.combine:
        try:
            return emit(combine(args.combine), args.out)
        except ConfigError as exc:
            print(f"trl_compare: {exc}", file=sys.stderr)
            return 2
    if args.only != "project" and (problem := missing_trl()):
        print(f"trl_compare: {problem}", file=sys.stderr)
        return 2
    if not args.config.is_file():
        print(f"trl_compare: no config file {args.config}", file=sys.stderr)
        return 2
    try:
        per_seed = trees(args)
    except ConfigError as exc:
        print(f"trl_compare: {exc}", file=sys.stderr)
        return 2
    config = args.config.resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
    head: dict = dict(benchmark="trl_compare", commit=git_commit(), config=str(shown),
                      budget=f"{args.steps} steps" if args.steps else f"{per_seed[0]['run']['max_minutes']} minutes",
                      model=per_seed[0]["models"][0]["name"], cores=os.cpu_count(), trl_threads=args.trl_threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as tmp:
        scorer = Scorer(Path(tmp))
        for tree in per_seed:
            seed = tree["run"]["seed"]
            results.append({**head, "seed": seed, **run_seed(tree, Path(tmp) / f"seed-{seed}", args.only,
                                                             args.trl_threads, scorer)})
    result = results[0] if args.seeds is None else {**head, "seeds": results, "summary": summary(results)}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
