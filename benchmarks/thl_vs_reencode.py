"""THL's token-level traces against HACPO's sequence-level re-encoding, on the same peer samples.

Each model of a two-model config samples ``--samples`` completions of ``--prompts`` training problems (its own
prompt format, the run's temperature and ``max_new_tokens``), scored by the task, as its generator would send
them. They reach the other model through the engine's own ingest (``engine.train.ingest``: THL's retokenization,
its aligned behaviour log-probs, a line-ending model's break read as its end), and the receiver's log-probs of the
bridged tokens are taken under its own prompt. For each direction, on those same samples:

- **THL, aligned traces** (PRP's density ratio, ``policies.objectives.prp_weights``, cap 2): per sample,
  w = min(exp(sum_t (log pi_recv - aligned log pi_peer)), 2) (``sequence``: the ratio of the two models'
  likelihoods of the same text, THL conserving the peer's log-prob sum), its length-normalised form, and per
  token over THL's aligned groups (``token``);
- **re-encoding** (HACPO's, ``policies.hacpo``): x = exp(mean over the receiver's tokens of log pi_recv - mean over
  the source's tokens of log pi_peer): two token counts, no alignment; as PRP's weight (min(x, 2)) and as HACPO
  uses it, clamped to [0.85, 1] (outside, no gradient).

Reported: the variance of each weight over samples (tokens for ``token``), the share truncated at the cap, the
share of peer tokens that enter the loss with a gradient (weight at least 1e-3 for PRP's; inside HACPO's clip for
its own), and the log-ratios' mean and spread. The last line is JSON.

    python -m benchmarks.thl_vs_reencode [--config configs/two_families.toml] [--prompts 32] [--samples 8]
                                         [--set KEY=VALUE ...] [--out results/two_families/thl_vs_reencode.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks import emit, git_commit

ROOT = Path(__file__).resolve().parents[1]
CAP = 2.0  # PRP's default ratio_cap
FLOOR = 1e-3  # a weight below this moves nothing: its tokens do not "enter" the loss


def loaded(model_cfg, cfg):
    from engine.config import model_spec, tokenizer_cache
    from policies.models import build_policy
    from tokenbridge import load_tokenizer

    spec = model_spec(model_cfg)
    tok = load_tokenizer(spec.tokenizer, tokenizer_cache(cfg))
    return spec, tok, build_policy(spec, tok).eval()


def sampled(model_cfg, cfg, task, tok, model, prompts: int, samples: int) -> list:
    """``samples`` completions of each of the first ``prompts`` training problems, as Experience messages."""
    import torch

    from exchange.protocol import SCHEMA_VERSION, Experience, pack_floats, pack_ids
    from policies.backend import HFBackend
    from policies.models import pad_token_id
    from policies.templates import end_ids, prompt_format, prompt_ids
    from tasks.rewards import score

    fmt = prompt_format(model_cfg)
    backend = HFBackend(model, tok.eos_token_id, pad_token_id(tok), stop_ids=end_ids(tok, fmt.end))
    problems = [task.problem(pid) for pid in range(prompts)]
    ids = [prompt_ids(tok, fmt, p.prompt) for p in problems]
    with torch.no_grad():
        groups = backend.generate(ids, samples, cfg.train.max_new_tokens, cfg.train.temperature, seed=cfg.run.seed)
    flat = [(p, i, k, s) for p, i, group in zip(problems, ids, groups) for k, s in enumerate(group)]
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for *_, s in flat]
    verdicts = score(task, [p for p, *_ in flat], texts, None, [s.completion_ids for *_, s in flat])
    now = time.time()
    return [Experience(schema=SCHEMA_VERSION, run_id="bench", experience_id=f"{model_cfg.name}/{p.prompt_id}/{k}/b",
                       model=model_cfg.name, task=p.task, prompt_id=p.prompt_id, sample_index=k, group_size=samples,
                       weight_version=0, prompt_ids=pack_ids(i), completion_ids=pack_ids(s.completion_ids),
                       behaviour_logprobs=pack_floats(s.logprobs), completion_text=t, reward=float(v.reward),
                       verified=bool(v.verified), finish_reason=s.finish_reason, created_at=now, generated_at=now)
            for (p, i, k, s), t, v in zip(flat, texts, verdicts)]


def received(dst, src, cfg, task, exps: list, samples: int) -> list:
    """The engine's ingest of ``exps`` (from ``src``) at ``dst``: bridged PeerSamples."""
    from engine.train.ingest import Ingest

    (dst_cfg, _, dst_tok, _), (src_cfg, _, src_tok, _) = dst, src
    ingest = Ingest(dst_cfg, dst_tok, {src_cfg.name: src_tok}, task, samples, run_id="bench",
                    peer_ends={src_cfg.name: src_cfg.end})
    ingest.add_many(exps)
    print(f"thl_vs_reencode: {src_cfg.name} -> {dst_cfg.name}: {sum(map(len, ingest.peers.values()))} of "
          f"{len(exps)} crossed, {ingest.failures} failed", file=sys.stderr, flush=True)
    return [p for pid in sorted(ingest.peers) for p in ingest.peers[pid]]


def figures(model, tok, peers: list) -> dict:
    """Each weight's variance, truncation and the share of peer tokens with a gradient, on ``peers``."""
    import numpy as np
    import torch

    from policies.logprobs import completion_logprobs, pack
    from policies.models import pad_token_id
    from policies.hacpo import cross_log_ratio
    from policies.objective_config import HACPOConfig
    from policies.objectives import prp_weights

    packed = pack([p.prompt_ids for p in peers], [p.completion_ids for p in peers], pad_token_id(tok))
    with torch.no_grad():
        logp = completion_logprobs(model, packed).double()
    T = logp.shape[1]
    behav = torch.tensor(np.stack([np.pad(p.behaviour_logprobs, (0, T - len(p.behaviour_logprobs)))
                                   for p in peers])).double()
    align = torch.tensor(np.stack([np.pad(p.align, (0, T - len(p.align)), constant_values=-1) for p in peers]))
    mask = packed.comp_mask.double()
    n_dst = mask.sum(dim=1)
    n_src = torch.tensor([float(p.source_tokens) for p in peers], dtype=torch.float64)
    out: dict = dict(samples=len(peers), dst_tokens_mean=float(n_dst.mean()), src_tokens_mean=float(n_src.mean()),
                     thl_residual_mean=statistics.fmean(p.residual for p in peers))
    for variant in ("sequence", "length_norm", "token"):
        w_tok, units, truncated = prp_weights(logp, behav, mask, align, variant, CAP)
        entered = float((mask * (w_tok >= FLOOR)).sum() / mask.sum())
        out[f"thl_{variant}"] = dict(w_var=float(units.var(unbiased=False)), w_mean=float(units.mean()),
                                     truncated_frac=float(truncated.double().mean()), tokens_entering=entered)
    log_seq = ((logp - behav) * mask).sum(dim=1)
    hacpo = HACPOConfig()
    log_x = cross_log_ratio(logp, behav, mask, n_src, hacpo.max_abs_log_ratio)
    x = log_x.exp()
    w = x.clamp(max=CAP)
    inside = (x >= hacpo.cross_clip_lower) & (x <= 1.0)
    out["reencode_prp"] = dict(w_var=float(w.var(unbiased=False)), w_mean=float(w.mean()),
                               truncated_frac=float((x > CAP).double().mean()),
                               tokens_entering=float((n_dst * (w >= FLOOR)).sum() / n_dst.sum()))
    out["reencode_hacpo"] = dict(x_var=float(x.var(unbiased=False)), x_mean=float(x.mean()),
                                 clipped_frac=float((~inside).double().mean()),
                                 tokens_entering=float((n_dst * inside).sum() / n_dst.sum()))
    out["log_ratio"] = dict(thl_sequence_mean=float(log_seq.mean()), thl_sequence_std=float(log_seq.std()),
                            reencode_mean=float(log_x.mean()), reencode_std=float(log_x.std()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.thl_vs_reencode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "two_families.toml")
    ap.add_argument("--prompts", type=int, default=32, help="training problems each model samples")
    ap.add_argument("--samples", type=int, default=8, help="completions of each problem (default 8: a group)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    from engine.config import ConfigError, load_run_config, run_task

    try:
        cfg = load_run_config(args.config, overrides=args.set)
        if len(cfg.models) != 2 or any(m.checkpoint is None for m in cfg.models):
            raise ConfigError(f"{args.config}: needs two models with checkpoints (it has "
                              f"{', '.join(m.name for m in cfg.models)})")
    except ConfigError as exc:
        print(f"thl_vs_reencode: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.manual_seed(cfg.run.seed)
    task = run_task(cfg)
    started = time.time()
    models = [(m, *loaded(m, cfg)) for m in cfg.models]
    exps = {m.name: sampled(m, cfg, task, tok, model, args.prompts, args.samples) for m, _, tok, model in models}
    shown = args.config.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    result: dict = dict(benchmark="thl_vs_reencode", commit=git_commit(), config=str(shown), prompts=args.prompts,
                        samples=args.samples, cap=CAP, hacpo_clip=[0.85, 1.0], directions={})
    for src, dst in ((models[0], models[1]), (models[1], models[0])):
        peers = received(dst, src, cfg, task, exps[src[0].name], args.samples)
        result["directions"][f"{src[0].name}->{dst[0].name}"] = figures(dst[3], dst[2], peers)
    result["seconds"] = round(time.time() - started, 1)
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
