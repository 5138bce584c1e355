"""policy/admission.py: each limit refuses exactly where admitting would pass it (never
below), Retry-After is the window's end, tiers shed flex → default → priority, per-model
limits apply with the tenant's, and the declared overshoot bound holds."""

import math
import random

import pytest

from ballast.settings import Settings
from policy.admission import (
    ADMIT,
    DAY_S,
    Demand,
    Headroom,
    LimitSet,
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
from protocol.requests import CHAT, COMPLETIONS, Limits, parse

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
    chat = parse(CHAT, dict(model="m", messages=[dict(role="user", content="héllo")], max_tokens=7), Limits("m", 100))
    assert estimate(chat, 100) == (len("userhéllo".encode()) + 16 + 32, 7)
    open_ended = parse(CHAT, dict(model="m", messages=[dict(role="user", content="hi")]), Limits("m", 100))
    i, o = estimate(open_ended, 100)
    assert i + o == 100
    ids = parse(COMPLETIONS, dict(model="m", prompt=[1, 2, 3], max_tokens=5), Limits("m", 100))
    assert estimate(ids, 100) == (3, 5)
    huge = parse(COMPLETIONS, dict(model="m", prompt="x" * 500, max_tokens=5), Limits("m", 100))
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


@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_the_declared_bound_holds_when_views_are_stale(processes, seed):
    """P processes admit from their own exact count plus the others' as of S ago: the
    window's total never passes L + bound (one process: never L), where the bound takes
    the most any process admitted within S; and nothing is refused while the true total
    still had room."""
    rnd = random.Random(seed)
    limit, stale_s, dt = 50, 3.2, 0.01
    lag = int(stale_s / dt)
    p_arrival = rnd.choice([0.02, 0.2, 1.0])  # per process per step
    own = [0] * processes
    history: list[list[int]] = []  # own counts at each step
    wrong = 0
    for step in range(int(30 / dt)):
        history.append(list(own))
        seen = history[max(0, step - lag)]
        for p in range(processes):
            if rnd.random() >= p_arrival:
                continue
            others = sum(seen[q] for q in range(processes) if q != p)
            usage = Usage(requests=own[p] + others)
            if admit(Demand("priority", 1, 1), [(LimitSet(requests_per_min=limit), usage)], NOW) == ADMIT:
                own[p] += 1
            elif sum(own) + 1 <= limit:
                wrong += 1
    history.append(list(own))
    peak = max(history[i][p] - history[max(0, i - lag)][p] for i in range(len(history)) for p in range(processes))
    assert sum(own) <= limit + overshoot_bound(limit, processes, peak / stale_s, stale_s)
    if processes == 1:
        assert sum(own) <= limit
    assert wrong == 0


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
