"""policy/admission.py: each limit refuses exactly where admitting would pass it (never
below), Retry-After is the window's end, tiers shed flex → default → priority, per-model
limits apply with the tenant's, and the declared overshoot bound holds."""

import heapq
import itertools
import math
import random

import pytest

from config import Settings
from policy.admission import (
    ADMIT,
    DAY_S,
    Demand,
    Headroom,
    Refuse,
    Usage,
    admit,
    admit_batch,
    describe,
    describe_batch,
    estimate,
    estimate_input,
    overshoot_bound,
    staleness_s,
)
from protocol.limits import LimitSet
from protocol.requests import CHAT, COMPLETIONS, RequestLimits, parse

NOW = 1_700_000_040 + 17.25  # 17.25 s into a UTC minute
MINUTE_LEFT = 43  # ⌈60 − 17.25⌉


SMALL = Demand("priority", 10, 10)


def one(limits: LimitSet, usage: Usage, demand: Demand = SMALL, now: float = NOW):
    return admit(demand, [(limits, usage)], now)


@pytest.mark.parametrize("dim, usage_at, demand, limit", [
    ("requests_per_min", lambda n: Usage(requests=n), Demand("priority", 10, 10), 5),
    ("input_tokens_per_min", lambda n: Usage(input_tokens=n), Demand("priority", 1, 10), 100),
    ("output_tokens_per_min", lambda n: Usage(output_tokens=n), Demand("priority", 10, 1), 100),
    ("concurrent_requests", lambda n: Usage(in_flight=n), Demand("priority", 10, 10), 3),
    ("tokens_per_day", lambda n: Usage(day_tokens=n), Demand("priority", 1, 0), 1000),
])
def test_each_limit_admits_right_up_to_it_and_refuses_past_it(dim, usage_at, demand, limit):
    limits = LimitSet(**{dim: limit})
    needed = {"requests_per_min": 1, "concurrent_requests": 1}.get(dim, 1)
    # Every usage from 0 to the last that still leaves room: admitted (no throttling below quota).
    for used in range(0, limit - needed + 1):
        assert one(limits, usage_at(used), demand) == ADMIT, (dim, used)
    refused = one(limits, usage_at(limit - needed + 1), demand)
    assert isinstance(refused, Refuse)
    assert (refused.limit, refused.value, refused.used, refused.requested) == (dim, limit, limit - needed + 1, needed)
    assert refused.shed_at == 1.0


def test_a_big_request_is_refused_where_a_small_one_fits():
    limits = LimitSet(input_tokens_per_min=100, output_tokens_per_min=100, tokens_per_day=500)
    assert one(limits, Usage(input_tokens=70), Demand("priority", 30, 1)) == ADMIT
    assert one(limits, Usage(input_tokens=70), Demand("priority", 31, 1)).limit == "input_tokens_per_min"
    assert one(limits, Usage(output_tokens=50), Demand("priority", 1, 50)) == ADMIT
    assert one(limits, Usage(output_tokens=50), Demand("priority", 1, 51)).limit == "output_tokens_per_min"
    assert one(limits, Usage(day_tokens=400), Demand("priority", 50, 50)) == ADMIT
    assert one(limits, Usage(day_tokens=400), Demand("priority", 50, 51)).limit == "tokens_per_day"


def test_no_limit_and_unlimited_dimensions_admit_anything():
    assert admit(Demand("flex", 10**9, 10**9), [], NOW) == ADMIT
    assert one(LimitSet(), Usage(10**9, 10**9, 10**9, 10**9, 10**9)) == ADMIT


def test_a_zero_limit_refuses_everything():
    assert one(LimitSet(requests_per_min=0), Usage()).limit == "requests_per_min"


def test_retry_after_is_the_end_of_the_window_and_at_least_one_second():
    assert one(LimitSet(requests_per_min=1), Usage(requests=1)).retry_after_s == MINUTE_LEFT
    assert one(LimitSet(input_tokens_per_min=1), Usage(input_tokens=1)).retry_after_s == MINUTE_LEFT
    late = math.floor(NOW / 60) * 60 + 59.9
    assert one(LimitSet(requests_per_min=1), Usage(requests=1), now=late).retry_after_s == 1
    day_end = (math.floor(NOW / DAY_S) + 1) * DAY_S
    assert one(LimitSet(tokens_per_day=1), Usage(day_tokens=1)).retry_after_s == math.ceil(day_end - NOW)
    assert one(LimitSet(concurrent_requests=1), Usage(in_flight=1)).retry_after_s == 1


def test_tiers_shed_flex_first_then_default_then_priority():
    limits = LimitSet(requests_per_min=100)

    def first_refused(tier: str) -> int:
        return next(n for n in range(0, 101) if admit(Demand(tier, 1, 1), [(limits, Usage(requests=n))], NOW) != ADMIT)

    assert (first_refused("flex"), first_refused("default"), first_refused("priority")) == (80, 95, 100)
    shed = admit(Demand("flex", 1, 1), [(limits, Usage(requests=80))], NOW)
    assert isinstance(shed, Refuse) and shed.shed_at == 0.8 and shed.retry_after_s == MINUTE_LEFT
    assert "for flex requests, which yield at 80% of the limit" in describe(shed, "acme", "m", "flex")


def test_tiers_share_one_window_in_order():
    """A window filled by a mix of tiers: flex stops being admitted first, priority last."""
    limits, usage, last = LimitSet(requests_per_min=40), 0, {}
    for n in range(200):
        tier = ("flex", "default", "priority")[n % 3]
        if admit(Demand(tier, 1, 1), [(limits, Usage(requests=usage))], NOW) == ADMIT:
            usage += 1
            last[tier] = usage
    assert usage == 40  # priority used the whole limit, no more
    assert last["flex"] <= 32 < last["default"] <= 38 < last["priority"] == 40


def test_headroom_is_configurable_and_a_tiny_limit_still_admits_one_of_every_tier():
    h = Headroom(priority=1.0, default=1.0, flex=0.5)
    assert admit(Demand("default", 1, 1), [(LimitSet(requests_per_min=10), Usage(requests=9))], NOW, h) == ADMIT
    assert admit(Demand("flex", 1, 1), [(LimitSet(requests_per_min=10), Usage(requests=5))], NOW, h) != ADMIT
    for tier in ("flex", "default", "priority"):
        assert admit(Demand(tier, 1, 1), [(LimitSet(concurrent_requests=1), Usage())], NOW) == ADMIT


def test_per_model_limits_apply_together_with_the_tenants():
    tenant, model = LimitSet("*", requests_per_min=10), LimitSet("m", requests_per_min=3)
    d = Demand("priority", 1, 1)
    assert admit(d, [(model, Usage(requests=2)), (tenant, Usage(requests=9))], NOW) == ADMIT
    by_model = admit(d, [(tenant, Usage(requests=5)), (model, Usage(requests=3))], NOW)
    assert isinstance(by_model, Refuse) and (by_model.model, by_model.value) == ("m", 3)
    by_tenant = admit(d, [(model, Usage(requests=0)), (tenant, Usage(requests=10))], NOW)
    assert isinstance(by_tenant, Refuse) and (by_tenant.model, by_tenant.value) == ("*", 10)
    assert describe(by_model, "acme", "m", "priority").startswith(
        "Rate limit reached for m in tenant acme on requests per min (RPM): Limit 3, Used 3, Requested 1.")
    assert "all models in tenant acme" in describe(by_tenant, "acme", "m", "priority")


def test_flex_is_shed_while_the_fleet_is_busy():
    refused = admit(Demand("flex", 1, 1), [], NOW, fleet_busy=True)
    assert isinstance(refused, Refuse) and refused.limit == "capacity" and refused.retry_after_s == 1
    assert describe(refused, "acme", "m", "flex").startswith("Resource unavailable")
    assert admit(Demand("default", 1, 1), [], NOW, fleet_busy=True) == ADMIT


def test_the_batch_queue_limit():
    limits = [(LimitSet("*", batch_queue_tokens=1000), 600)]
    assert admit_batch(400, limits) == ADMIT
    refused = admit_batch(401, limits)
    assert isinstance(refused, Refuse) and (refused.limit, refused.value) == ("batch_queue_tokens", 1000)
    assert describe_batch(refused, "acme", "m") == (
        "Enqueued token limit reached for m in tenant acme. Limit: 1,000 enqueued tokens. "
        "Please try again once some in_progress batches have been completed.")
    assert admit_batch(10**9, [(LimitSet("*"), 10**9)]) == ADMIT


def test_the_estimate_bounds_bytes_and_reserves_the_rest_of_the_context():
    chat = parse(CHAT, dict(model="m", messages=[dict(role="user", content="héllo")], max_tokens=7),
                 RequestLimits("m", 100))
    assert estimate(chat, 100) == (len("userhéllo".encode()) + 16 + 32, 7)
    open_ended = parse(CHAT, dict(model="m", messages=[dict(role="user", content="hi")]), RequestLimits("m", 100))
    i, o = estimate(open_ended, 100)
    assert i + o == 100
    ids = parse(COMPLETIONS, dict(model="m", prompt=[1, 2, 3], max_tokens=5), RequestLimits("m", 100))
    assert estimate(ids, 100) == (3, 5)
    huge = parse(COMPLETIONS, dict(model="m", prompt="x" * 500, max_tokens=5), RequestLimits("m", 100))
    assert estimate(huge, 100)[0] == 100  # capped at the context: the engine refuses the rest
    assert estimate_input(["abc"], 0) == 5


def test_the_staleness_and_bound_come_from_the_settings():
    s = Settings(admission_flush_s=0.1, admission_refresh_s=1.0)
    assert s.admission_staleness_s == staleness_s(0.1, 1.0) == pytest.approx(3.2)
    assert overshoot_bound(100, 1, 1000.0, 2.2) == 0
    assert overshoot_bound(100, 4, 10.0, 2.2) == 3 * 22
    assert overshoot_bound(100, 4, 1000.0, 2.2) == 300  # each process is stopped by its own view at the limit
    with pytest.raises(ValueError, match="HEADROOM"):
        Settings(admission_headroom_flex=0.99, admission_headroom_default=0.9)


def _most_within(times: list[float], span_s: float) -> int:
    """The most of `times` (sorted) inside any `span_s`-long stretch."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > span_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _simulate(processes: int, flush_s: float, refresh_s: float, limit: int, rate: float, seconds: float,
              rnd: random.Random, fold_overrun_s: float = 0.0):
    """P admitting processes on the real schedule, in virtual time (api/services/admission.py,
    workflows/quota.py). Each process decides from its own admissions (exact) plus the
    others' in its view; flushes its reserves every `flush_s` at a phase of its own (one
    that the engine has not sized yet waits one tick: half of them here); the reconciler
    folds the rows committed by its start every `refresh_s` at a fixed rate (the next
    starts `refresh_s` after this one began, or when it ends, then a timer that fires
    late); each process re-reads the newest finished fold every `refresh_s` at its own
    phase. The flush, the fold, the timer's lateness and the refresh each take up to a
    quarter of a refresh period (together at most one: what S allows them), plus
    `fold_overrun_s` for the fold. Nothing here is told S: how late a view is comes out
    of the schedule. Returns (admitted per process, their times, each delay from an
    admission to its appearance in another process's view, requests refused while the
    true total had room)."""
    quarter = refresh_s / 4
    heap: list = []
    seq = itertools.count()

    def at(t: float, kind: str, p: int = -1, data: tuple[int, ...] = ()) -> None:
        heapq.heappush(heap, (t, next(seq), kind, p, data))

    for p in range(processes):
        at(rnd.uniform(0, flush_s), "flush", p)
        at(rnd.uniform(0, refresh_s), "refresh", p)
        t = rnd.expovariate(rate)
        while t < seconds:
            at(t, "arrive", p)
            t += rnd.expovariate(rate)
    at(rnd.uniform(0, refresh_s), "fold")
    own = [0] * processes
    admitted: list[list[float]] = [[] for _ in range(processes)]
    pending: list[list[list[bool]]] = [[] for _ in range(processes)]  # [sized by the API, waited a tick]
    committed: list[tuple[float, int]] = []  # (commit time, process) per reserve row
    folds: list[tuple[float, tuple[int, ...]]] = [(0.0, (0,) * processes)]  # (finished at, rows per process)
    view = [[0] * processes for _ in range(processes)]
    delays: list[float] = []
    wrong = 0
    while heap:
        t, _, kind, p, data = heapq.heappop(heap)
        if t > seconds + 30:  # long after the last arrival: every view has caught up
            break
        if kind == "arrive":
            usage = Usage(requests=own[p] + sum(view[p][q] for q in range(processes) if q != p))
            if admit(Demand("priority", 1, 1), [(LimitSet(requests_per_min=limit), usage)], NOW) == ADMIT:
                own[p] += 1
                admitted[p].append(t)
                pending[p].append([rnd.random() < 0.5, False])
            elif sum(own) + 1 <= limit:
                wrong += 1
        elif kind == "flush":
            ready = [x for x in pending[p] if x[0] or x[1]]
            pending[p] = [x for x in pending[p] if not (x[0] or x[1])]
            for x in pending[p]:
                x[1] = True
            committed += [(t + rnd.uniform(0, min(flush_s, quarter)), p)] * len(ready)
            at(t + flush_s, "flush", p)
        elif kind == "fold":
            took = rnd.uniform(0, quarter) + fold_overrun_s
            folds.append((t + took, tuple(sum(1 for c, q in committed if c <= t and q == r)
                                          for r in range(processes))))
            at(t + max(refresh_s, took) + rnd.uniform(0, quarter), "fold")
        elif kind == "refresh":
            at(t + rnd.uniform(0, quarter), "view", p, [rows for done, rows in folds if done <= t][-1])
            at(t + refresh_s, "refresh", p)
        elif kind == "view":
            for q in range(processes):
                if q != p:
                    delays += [t - a for a in admitted[q][view[p][q]:data[q]]]
            view[p] = list(data)
    assert all(view[p][q] == own[q] for p in range(processes) for q in range(processes) if q != p)
    return own, admitted, delays, wrong


@pytest.mark.parametrize("flush_s, refresh_s", [(0.1, 1.0), (0.05, 0.5), (0.5, 2.0), (0.25, 0.25)])
@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("rate", [15.0, 60.0])
@pytest.mark.parametrize("seed", range(2))
def test_the_declared_bound_holds_on_the_real_flush_and_refresh_schedule(flush_s, refresh_s, processes, rate, seed):
    """On the flush / fold / refresh schedule, simulated: every admission reaches every
    other process's view within S = 2 × flush + 3 × refresh (docs/quotas-and-audit.md), the window's total
    never passes L + (P − 1) × min(L, the most one process admitted within S) (one
    process: never L), and nothing is refused while the true total had room."""
    limit = 200
    stale_s = 2 * flush_s + 3 * refresh_s  # as docs/quotas-and-audit.md states S, by hand
    assert staleness_s(flush_s, refresh_s) == pytest.approx(stale_s)
    assert Settings(admission_flush_s=flush_s, admission_refresh_s=refresh_s).admission_staleness_s == \
        pytest.approx(stale_s)
    own, admitted, delays, wrong = _simulate(processes, flush_s, refresh_s, limit, rate, 20.0, random.Random(seed))
    assert sum(own) >= limit  # the limit was reached: the bound had something to bound
    assert max(delays, default=0.0) < stale_s
    peak = max(_most_within(times, stale_s) for times in admitted)
    assert sum(own) <= limit + (processes - 1) * min(limit, peak)
    assert sum(own) <= limit + overshoot_bound(limit, processes, peak / stale_s, stale_s)
    if processes == 1:
        assert sum(own) == limit
    assert wrong == 0


def test_views_later_than_s_pass_the_bound():
    """The check above can fail: a fold that overruns its period by two makes views later
    than S, and then the total passes L + the bound computed with S."""
    limit, flush_s, refresh_s, processes = 1000, 0.1, 1.0, 2
    stale_s = 2 * flush_s + 3 * refresh_s
    over = []
    for seed in range(3):
        own, admitted, delays, _ = _simulate(processes, flush_s, refresh_s, limit, 100.0, 30.0, random.Random(seed),
                                             fold_overrun_s=2 * refresh_s)
        assert max(delays) > stale_s
        peak = max(_most_within(times, stale_s) for times in admitted)
        over.append(sum(own) - (limit + (processes - 1) * min(limit, peak)))
    assert max(over) > 0, over


def test_a_fine_tune_is_admitted_while_every_limit_has_a_place_left():
    from policy.admission import FINE_TUNE_RETRY_S, admit_fine_tune

    everything, tiny = LimitSet("*", concurrent_fine_tunes=3), LimitSet("tiny", concurrent_fine_tunes=1)
    assert admit_fine_tune([]) == ADMIT and admit_fine_tune([(LimitSet("*"), 99)]) == ADMIT  # none set
    assert admit_fine_tune([(everything, 2), (tiny, 0)]) == ADMIT
    assert admit_fine_tune([(tiny, 1), (everything, 2)]) == Refuse("concurrent_fine_tunes", 1, FINE_TUNE_RETRY_S,
                                                                    "tiny", 1, 1)
    # '*' is checked first, whatever the order given.
    assert admit_fine_tune([(tiny, 1), (everything, 3)]) == Refuse("concurrent_fine_tunes", 3, FINE_TUNE_RETRY_S,
                                                                    "*", 3, 1)
    assert admit_fine_tune([(LimitSet("*", concurrent_fine_tunes=0), 0)]).limit == "concurrent_fine_tunes"


def test_training_waits_once_a_days_tokens_are_spent_in_any_scope():
    from policy.admission import day_spent

    everything, this_model = LimitSet(tokens_per_day=100), LimitSet(model="m", tokens_per_day=10)
    assert day_spent([]) is None and day_spent([(LimitSet(requests_per_min=1), 10**9)]) is None
    assert day_spent([(everything, 99), (this_model, 9)]) is None
    assert day_spent([(this_model, 10), (everything, 100)]) == everything  # '*' is named first
    assert day_spent([(everything, 5), (this_model, 10)]) == this_model
