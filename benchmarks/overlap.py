"""What two models could learn from each other, before RL: the held-out problems each solves greedily, and those
solved by exactly one of them.

A peer's success can only teach a model a problem that the peer solves and it does not; a pair whose successes
coincide has nothing to share. For each model of a config (in its own prompt format: ``[[models]] prompt`` and
``end``) this decodes the same held-out problems greedily, as the run's evaluation does, and reports its accuracy,
then for each pair the share solved by both, by exactly one (and which), and by neither, with a few of each
model's completions to read.

    python -m benchmarks.overlap [--config configs/two_families.toml] [--problems 1000] [--set KEY=VALUE ...]
                                 [--out results/two_families/overlap.json]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

from benchmarks import emit

ROOT = Path(__file__).resolve().parents[1]


def solved(model_cfg, cfg, task, problems) -> tuple[list[bool], list[str], float]:
    """Greedy verdicts and completions of one model on ``problems`` (its own prompt format and end tokens)."""
    import torch

    from engine.config import model_spec, tokenizer_cache
    from policies.backend import HFBackend
    from policies.models import build_policy, pad_token_id
    from policies.templates import end_ids, prompt_format, prompt_ids
    from tasks.rewards import score
    from tokenbridge import load_tokenizer

    spec = model_spec(model_cfg)
    tok = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    model = build_policy(spec, tok).eval()
    fmt = prompt_format(model_cfg)
    backend = HFBackend(model, tok.eos_token_id, pad_token_id(tok), stop_ids=end_ids(tok, fmt.end))
    verdicts: list[bool] = []
    texts: list[str] = []
    cut = 0
    started = time.time()
    for start in range(0, len(problems), cfg.eval.batch_size):
        batch = problems[start:start + cfg.eval.batch_size]
        with torch.no_grad():
            samples = backend.generate([prompt_ids(tok, fmt, p.prompt) for p in batch], 1,
                                       cfg.eval_max_new_tokens, 0.0, seed=start)
        out = [tok.decode(s.completion_ids, skip_special_tokens=True) for (s,) in samples]
        verdicts += [v.verified for v in score(task, batch, out, [], [s.completion_ids for (s,) in samples])]
        texts += out
        cut += sum(s.finish_reason == "length" for (s,) in samples)
        print(f"overlap: {model_cfg.name} {len(verdicts)}/{len(problems)}, accuracy so far "
              f"{sum(verdicts) / len(verdicts):.3f}, {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    return verdicts, texts, cut / len(problems)


def pair_shares(a: list[bool], b: list[bool]) -> dict:
    n = len(a)
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    both = sum(x and y for x, y in zip(a, b))
    exactly_one = (only_a + only_b) / n
    return dict(both=both / n, only_first=only_a / n, only_second=only_b / n, neither=(n - both - only_a - only_b) / n,
                exactly_one=exactly_one, exactly_one_se=math.sqrt(exactly_one * (1 - exactly_one) / n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "two_families.toml")
    ap.add_argument("--problems", type=int, help="held-out problems (default: the config's eval.num_problems)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    from engine.config import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config, overrides=args.set)
    except ConfigError as exc:
        print(f"overlap: {exc}", file=sys.stderr)
        return 2
    import torch

    from engine.prep.evaluation import held_out_problems
    from engine.config import run_task

    torch.manual_seed(cfg.run.seed)
    task = run_task(cfg)
    problems = held_out_problems(task, args.problems or cfg.eval.num_problems)
    result: dict = dict(benchmark="overlap", config=str(args.config), n=len(problems), models={}, pairs={})
    verdicts = {}
    for m in cfg.models:
        if m.checkpoint is None:
            print(f"overlap: {m.name} is built from scratch (its warm start comes with a run); skipped", file=sys.stderr)
            continue
        verdicts[m.name], texts, cut = solved(m, cfg, task, problems)
        acc = sum(verdicts[m.name]) / len(problems)
        result["models"][m.name] = dict(accuracy=acc, stderr=math.sqrt(acc * (1 - acc) / len(problems)),
                                        truncated=cut, examples=[dict(question=p.question, answer=p.answer, wrote=t)
                                                                 for p, t in zip(problems[:8], texts[:8])])
    for first, second in itertools.combinations(verdicts, 2):
        result["pairs"][f"{first}|{second}"] = pair_shares(verdicts[first], verdicts[second])
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
