"""Student-t intervals and paired tests over seeds, in plain Python (no SciPy dependency).

The t distribution's CDF is the regularized incomplete beta function, computed with
Lentz's continued fraction; quantiles by bisection. Accurate to ~1e-10, far below what
three seeds can resolve.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev
from typing import NamedTuple


class Estimate(NamedTuple):
    mean: float
    low: float  # 95% interval (nan with one value)
    high: float
    p: float  # two-sided p-value of "the mean is 0" (nan with one value)
    n: int


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(q: float, df: float) -> float:
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def estimate(values: list[float]) -> Estimate:
    """Mean with its 95% t interval and the p-value of a one-sample t-test against 0."""
    n = len(values)
    mean = fmean(values)
    if n < 2:
        return Estimate(mean, math.nan, math.nan, math.nan, n)
    se = stdev(values) / math.sqrt(n)
    if se == 0:
        return Estimate(mean, mean, mean, 1.0 if mean == 0 else 0.0, n)
    half = t_quantile(0.975, n - 1) * se
    p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return Estimate(mean, mean - half, mean + half, p, n)


def verdict(e: Estimate) -> str:
    """'better' / 'worse' if the 95% interval excludes 0, else 'no clear difference'."""
    if math.isnan(e.low):
        return "one seed, no interval"
    return "better" if e.low > 0 else "worse" if e.high < 0 else "no clear difference"
