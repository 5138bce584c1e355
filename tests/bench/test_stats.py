"""bench.stats against outside references: numpy's percentile for the nearest rank, and
samples drawn from distributions whose quantiles are known in closed form for the
intervals (an exponential's q-quantile is -scale * ln(1 - q))."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest

from bench.stats import diff_ci, p50, p99, pct, ratio_ci


def exp_sample(scale: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.expovariate(1 / scale) for _ in range(n)]


def exp_quantile(scale: float, q: float) -> float:
    return -scale * math.log(1 - q)


@pytest.mark.parametrize("n", [1, 2, 7, 60, 100, 134, 1000])
@pytest.mark.parametrize("p", [0, 1, 7, 25, 50, 90, 99, 99.9, 100])
def test_pct_is_the_nearest_rank(n: int, p: float) -> None:
    xs = exp_sample(1.0, n, seed=n)
    rank = Fraction(str(p)) * n / 100  # exact: the definition, the smallest rank at or above p % of n
    assert pct(xs, p) == sorted(xs)[max(1, math.ceil(rank)) - 1]
    if rank.denominator != 1:  # numpy computes p * n in floating point: 7 % of 100 is rank 8 there
        assert pct(xs, p) == float(np.percentile(xs, p, method="inverted_cdf"))


def test_p99_of_a_hundred_is_the_ninety_ninth_not_the_slowest() -> None:
    xs = list(range(1, 101))
    random.Random(0).shuffle(xs)
    assert (p50(xs), p99(xs), pct(xs, 100)) == (50, 99, 100)
    assert pct([], 99) == 0.0


def test_ratio_interval_covers_the_known_ratio() -> None:
    # Arm twice the baseline's scale: every quantile's ratio is exactly 2.
    arm, base = exp_sample(2.0, 2000, seed=1), exp_sample(1.0, 2000, seed=2)
    for stat in (p50, p99):
        r = ratio_ci(arm, base, stat, resamples=500)
        assert r.lo < 2.0 < r.hi, (stat.__name__, r)
        assert r.lo <= r.ratio <= r.hi
        assert (r.n_arm, r.n_base) == (2000, 2000)


def test_ratio_interval_coverage_is_near_its_level() -> None:
    """Over independent experiments the 95 % interval of the median's ratio holds the
    true ratio (2) about 95 % of the time, not ~100 % (too wide to say anything) nor
    far less (too narrow to trust)."""
    hits = 0
    trials = 80
    for t in range(trials):
        r = ratio_ci(exp_sample(2.0, 200, seed=1000 + t), exp_sample(1.0, 200, seed=5000 + t), p50,
                     resamples=400, seed=t)
        hits += r.lo <= 2.0 <= r.hi
    assert 0.85 <= hits / trials < 1.0, hits  # 75 of 80 with these seeds


def test_interval_is_deterministic_by_seed() -> None:
    arm, base = exp_sample(1.5, 300, seed=3), exp_sample(1.0, 300, seed=4)
    assert ratio_ci(arm, base, seed=7, resamples=300) == ratio_ci(arm, base, seed=7, resamples=300)
    assert ratio_ci(arm, base, seed=7, resamples=300) != ratio_ci(arm, base, seed=8, resamples=300)
    assert diff_ci(arm, base, seed=7, resamples=300) == diff_ci(arm, base, seed=7, resamples=300)


def test_interval_narrows_with_n() -> None:
    widths = []
    for n in (100, 1000, 5000):
        r = ratio_ci(exp_sample(2.0, n, seed=n), exp_sample(1.0, n, seed=n + 1), p99, resamples=500)
        widths.append(r.hi - r.lo)
    assert widths[0] > widths[1] > widths[2], widths


def test_difference_interval_covers_the_known_difference() -> None:
    # Medians: scale * ln 2, so 3 ln 2 - 1 ln 2 = 2 ln 2.
    arm, base = exp_sample(3.0, 2000, seed=5), exp_sample(1.0, 2000, seed=6)
    d = diff_ci(arm, base, p50, resamples=500)
    truth = exp_quantile(3.0, 0.5) - exp_quantile(1.0, 0.5)
    assert d.lo < truth < d.hi, d
    assert d.as_dict(scale=1000)["diff"] == round(1000 * d.diff, 2)


def test_groups_resample_whole_groups() -> None:
    """Each value four times over (a burst of four that shares its fate) is 100 draws,
    not 400: resampled by group, the interval is as wide as that of the 100 values
    alone; resampled one by one it is about half as wide, and it would lie."""
    arm, base = exp_sample(2.0, 100, seed=8), exp_sample(1.0, 100, seed=9)
    arm4, base4 = [x for x in arm for _ in range(4)], [x for x in base for _ in range(4)]
    keys_arm, keys_base = [i // 4 for i in range(400)], [i // 4 for i in range(400)]
    alone = ratio_ci(arm, base, p50)
    grouped = ratio_ci(arm4, base4, p50, groups=(keys_arm, keys_base))
    naive = ratio_ci(arm4, base4, p50)
    width = {k: r.hi - r.lo for k, r in dict(alone=alone, grouped=grouped, naive=naive).items()}
    assert width["grouped"] == pytest.approx(width["alone"], rel=0.25), width
    assert width["naive"] < 0.75 * width["grouped"], width


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError):
        ratio_ci([], [1.0])
    with pytest.raises(ValueError):
        ratio_ci([1.0], [0.0, 0.0])
    with pytest.raises(ValueError):
        ratio_ci([1.0, 2.0], [1.0], groups=([0], [0]))
