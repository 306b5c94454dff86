"""trl_compare's seeds read together: each figure's mean with its 95% Student-t interval, and single seeds run apart
combined into one result (``python -m benchmarks.trl_compare --combine``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_of(values: list) -> float | None:
    """The mean of the values that exist (None where there are none)."""
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def t975(dof: int) -> float:
    """Student t's 0.975 quantile with ``dof`` degrees of freedom."""
    if dof in T975:
        return T975[dof]
    z = 1.959964
    return (z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3))


def interval(values: list) -> dict:
    """Mean and 95% Student-t interval (n - 1 degrees of freedom) of the values that exist (a gain ratio does not
    where TRL gained nothing); no interval from fewer than two."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return dict(n=0, mean=None, lo=None, hi=None)
    mean = statistics.fmean(kept)
    if len(kept) < 2:
        return dict(n=1, mean=mean, lo=None, hi=None)
    half = t975(len(kept) - 1) * statistics.stdev(kept) / math.sqrt(len(kept))
    return dict(n=len(kept), mean=mean, lo=mean - half, hi=mean + half)


def summary(results: list[dict]) -> dict:
    """Each side's gain and each ratio over the seeds: ``interval`` of each."""
    pick = {"project_gain_pts": lambda r: r.get("project", {}).get("gain_pts"),
            "trl_gain_pts": lambda r: r.get("trl", {}).get("gain_pts"),
            **{k: (lambda r, k=k: r.get(k)) for k in ("gain_ratio", "samples_per_s_ratio", "pss_ratio")}}
    return {name: interval([get(r) for r in results]) for name, get in pick.items()}


SAME = ("benchmark", "commit", "config", "budget", "model", "cores", "trl_threads")  # what seeds combined must share


def combine(paths: list[Path]) -> dict:
    """Results of single seeds (or of ``--seeds``), run apart, as one ``--seeds`` result: each seed and the summary.
    They must come from one commit and one setup, each seed once; anything else is a ConfigError naming it."""
    from engine.config import ConfigError

    results = []
    for path in paths:
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--combine {path}: not a trl_compare result ({exc})") from None
        if not isinstance(found, dict) or found.get("benchmark") != "trl_compare":
            raise ConfigError(f"--combine {path}: not a trl_compare result")
        results += found["seeds"] if "seeds" in found else [found]
    for r in results[1:]:
        if (key := next((k for k in SAME if r.get(k) != results[0].get(k)), None)) is not None:
            raise ConfigError(f"--combine: seed {r.get('seed')} has {key} {r.get(key)!r} where seed "
                              f"{results[0].get('seed')} has {results[0].get(key)!r}: combine one commit's one setup")
    seeds = [r.get("seed") for r in results]
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--combine: seeds {seeds}: each seed once")
    results.sort(key=lambda r: r["seed"])
    return {**{k: results[0].get(k) for k in SAME}, "seeds": results, "summary": summary(results)}
