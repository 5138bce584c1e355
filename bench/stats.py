"""The statistics every benchmark reports: nearest-rank percentiles and bootstrap
confidence intervals for the ratio (or difference) of a statistic between two arms
measured side by side.

A p99 over a hundred requests is one or two requests; the interval says how far the
figure could move on another run of the same size, so a figure is read with its width.
Requests that share fate (a burst that arrives together, a run of consecutive requests
in one slow phase of the machine) are not independent draws: give each sample its group
and whole groups are resampled, which widens the interval as far as they move together.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

Stat = Callable[[Sequence[float]], float]
Groups = tuple[Sequence[Hashable], Sequence[Hashable]]  # each sample's group, arm then baseline


def pct(xs: Iterable[float], p: float) -> float:
    """Nearest-rank percentile of `xs` (any order): the smallest value with at least p %
    of the samples at or below it; 0 for none. Every benchmark's percentiles and medians
    are this one (a median of an even count is the lower middle, never a mean of two)."""
    s = sorted(xs)
    if not s:
        return 0.0
    # The fuzz keeps 0.07 * 100 = 7.000000000000001 at rank 7, not 8.
    rank = math.ceil(p / 100 * len(s) - 1e-9)
    return s[min(len(s), max(1, rank)) - 1]


def p50(xs: Iterable[float]) -> float:
    return pct(xs, 50)


def p99(xs: Iterable[float]) -> float:
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


@dataclass(frozen=True)
class Difference:
    """stat(arm) - stat(baseline), with a percentile-bootstrap interval."""

    diff: float
    lo: float
    hi: float
    n_arm: int
    n_base: int

    def as_dict(self, digits: int = 2, scale: float = 1.0) -> dict[str, float | int | list[float]]:
        """`scale`: e.g. 1000 for seconds shown as milliseconds."""
        return dict(diff=round(scale * self.diff, digits),
                    ci95=[round(scale * self.lo, digits), round(scale * self.hi, digits)],
                    n=self.n_arm, n_baseline=self.n_base)


def ratio_ci(arm: Sequence[float], base: Sequence[float], stat: Stat = p99, *, resamples: int = 2000,
             level: float = 0.95, seed: int = 0, groups: Groups | None = None) -> Ratio:
    """stat(arm) / stat(base) and its percentile-bootstrap interval: both samples are
    resampled with replacement, independently, `resamples` times (seeded: the same data
    gives the same interval); by whole groups where `groups` gives each sample's."""
    lo, hi = _interval(arm, base, lambda a, b: stat(a) / sb if (sb := stat(b)) else None,
                       resamples, level, seed, groups)
    if not stat(base):
        raise ValueError("the baseline's statistic is 0: no ratio")
    return Ratio(stat(arm) / stat(base), lo, hi, len(arm), len(base))


def diff_ci(arm: Sequence[float], base: Sequence[float], stat: Stat = p99, *, resamples: int = 2000,
            level: float = 0.95, seed: int = 0, groups: Groups | None = None) -> Difference:
    """stat(arm) - stat(base) and its percentile-bootstrap interval, as `ratio_ci`."""
    lo, hi = _interval(arm, base, lambda a, b: stat(a) - stat(b), resamples, level, seed, groups)
    return Difference(stat(arm) - stat(base), lo, hi, len(arm), len(base))


def _interval(arm: Sequence[float], base: Sequence[float], estimate: Callable[[list[float], list[float]], float | None],
              resamples: int, level: float, seed: int, groups: Groups | None) -> tuple[float, float]:
    if not arm or not base:
        raise ValueError("an interval needs samples in both arms")
    rng = random.Random(seed)
    draw_arm = _resampler(arm, groups[0] if groups else None, rng)
    draw_base = _resampler(base, groups[1] if groups else None, rng)
    boots = [e for _ in range(resamples) if (e := estimate(draw_arm(), draw_base())) is not None]
    if len(boots) < resamples / 2:  # the baseline's statistic was 0 in most resamples
        raise ValueError("the baseline's statistic is 0 in most resamples: no interval for a ratio")
    tail = (1 - level) / 2
    return pct(boots, 100 * tail), pct(boots, 100 * (1 - tail))


def _resampler(xs: Sequence[float], keys: Sequence[Hashable] | None,
               rng: random.Random) -> Callable[[], list[float]]:
    """A draw of len(xs) samples with replacement; with `keys`, as many whole groups as
    there are groups."""
    if keys is None:
        return lambda: rng.choices(xs, k=len(xs))
    if len(keys) != len(xs):
        raise ValueError("one group key per sample")
    by_key: dict[Hashable, list[float]] = {}
    for k, x in zip(keys, xs, strict=True):
        by_key.setdefault(k, []).append(x)
    clusters = list(by_key.values())
    return lambda: [x for c in rng.choices(clusters, k=len(clusters)) for x in c]
