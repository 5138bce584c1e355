"""The statistics every benchmark reports: nearest-rank percentiles and a bootstrap
confidence interval for the ratio of a statistic between two arms measured side by side.

A p99 over a hundred requests is one or two requests; the interval says how far the
ratio could move on another run of the same size, so a figure is read with its width.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def pct(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of `xs` (any order); 0 for none."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def p50(xs: Sequence[float]) -> float:
    return pct(xs, 50)


def p99(xs: Sequence[float]) -> float:
    return pct(xs, 99)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass(frozen=True)
class Ratio:
    """stat(arm) / stat(baseline), with a percentile-bootstrap interval."""

    ratio: float
    lo: float
    hi: float
    n_arm: int
    n_base: int

    def as_dict(self, digits: int = 3) -> dict[str, float | int | list[float]]:
        return dict(ratio=round(self.ratio, digits), ci95=[round(self.lo, digits), round(self.hi, digits)],
                    n=self.n_arm, n_baseline=self.n_base)


def ratio_ci(arm: Sequence[float], base: Sequence[float], stat: Callable[[Sequence[float]], float] = p99,
             *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Ratio:
    """stat(arm) / stat(base) and its percentile-bootstrap interval: both samples are
    resampled with replacement, independently, `resamples` times (seeded: the same data
    gives the same interval)."""
    if not arm or not base:
        raise ValueError("a ratio needs samples in both arms")
    rng = random.Random(seed)
    point = stat(arm) / stat(base)
    boots = []
    for _ in range(resamples):
        a = rng.choices(arm, k=len(arm))
        b = rng.choices(base, k=len(base))
        sb = stat(b)
        if sb:
            boots.append(stat(a) / sb)
    tail = (1 - level) / 2
    return Ratio(point, pct(boots, 100 * tail), pct(boots, 100 * (1 - tail)), len(arm), len(base))
