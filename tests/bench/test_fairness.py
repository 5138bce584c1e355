"""bench/fairness.py's client-side measures on hand-made streams: which SSE chunks carry
tokens, how a response's service is placed in time, the service difference over any
interval, and the stretches where both tenants had requests waiting."""

import pytest

from bench.fairness import (
    Tenant,
    backlogged_stretches,
    both_share,
    counter_difference,
    max_service_difference,
    outstanding_min,
    service_events,
    token_event,
)


def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> dict:
    """A chat.completion.chunk as OpenAI's API reference shows one."""
    c: dict = dict(id="chatcmpl-1", object="chat.completion.chunk", created=1, model="m",
                   choices=[] if delta is None else [dict(index=0, delta=delta, finish_reason=finish, logprobs=None)])
    if usage is not None:
        c["usage"] = usage
    return c


def test_token_events_are_deltas_after_the_role_and_before_the_finish():
    assert not token_event(chunk({"role": "assistant", "content": ""}))
    assert token_event(chunk({"content": "a"}))
    assert token_event(chunk({}))  # a token whose text is part of a character
    assert not token_event(chunk({}, "length"))
    assert not token_event(chunk(None, usage=dict(prompt_tokens=3, completion_tokens=2, total_tokens=5)))


def test_a_response_is_weighted_input_plus_twice_output_at_the_client():
    assert service_events([1.0, 2.0, 3.0], 10, 3) == [(1.0, 10), (1.0, 2.0), (2.0, 2.0), (3.0, 2.0)]
    # six tokens in three events: two tokens (4 weighted) per event
    assert service_events([1.0, 2.0, 3.0], 10, 6)[1:] == [(1.0, 4.0), (2.0, 4.0), (3.0, 4.0)]
    assert sum(w for _, w in service_events([5.0, 6.0], 640, 320)) == 640 + 2 * 320


def tenant(name: str, events: list[tuple[float, float]]) -> Tenant:
    return Tenant(name, "k", 1, 1, events=events)


def test_the_service_difference_is_the_largest_over_any_interval():
    a = tenant("short", [(1.0, 100), (2.0, 100), (5.0, 100)])
    b = tenant("long", [(3.0, 300), (4.0, 50)])
    # running difference: 100, 200, −100, −150, −50 (and 0 before): any interval's is a
    # difference of two of these; the largest is 200 − (−150)
    assert max_service_difference(a, b, 0.0, 10.0) == 350
    assert max_service_difference(a, b, 0.0, 2.5) == 200  # [1, 2]: a only
    assert max_service_difference(a, b, 2.5, 4.5) == 350  # [3, 4]: b only
    assert max_service_difference(a, b, 6.0, 9.0) == 0


def test_stretches_where_both_tenants_waited():
    both, one = {"short": 2, "long": 1}, {"long": 3}
    queued = [(0.0, both), (0.05, both), (0.1, one), (0.15, both), (0.2, {}), (0.25, both), (0.3, both)]
    assert backlogged_stretches(queued, 0.0, 1.0) == [(0.0, 0.05), (0.15, 0.15), (0.25, 0.3)]
    assert backlogged_stretches(queued, 0.05, 0.26) == [(0.05, 0.05), (0.15, 0.15), (0.25, 0.25)]
    assert both_share(queued, 0.0, 1.0) == pytest.approx(5 / 7)
    assert backlogged_stretches([(0.0, one)], 0.0, 1.0) == []


def test_a_client_difference_past_the_bound_inside_a_stretch_is_reported():
    """Not vacuous: 3,000 more to one tenant while both waited is seen as 3,000."""
    a = tenant("short", [(0.1, 1000), (0.2, 1000), (0.3, 1000), (2.0, 5000)])
    b = tenant("long", [(1.5, 10)])
    (s, e), = backlogged_stretches([(0.0, {"short": 1, "long": 1}), (1.0, {"short": 1, "long": 1}),
                                    (1.9, {"long": 1})], 0.0, 3.0)
    assert max_service_difference(a, b, s, e) == 3000


def test_the_scheduler_counters_and_outstanding_requests():
    served = [(0.0, {"short": 0, "long": 0}), (1.0, {"short": 500, "long": 100}), (2.0, {"short": 600, "long": 900})]
    assert counter_difference(served, 0.0, 2.0) == 400 - (-300)
    t = tenant("short", [])
    t.outstanding = [(0.0, 5), (1.0, 3), (2.0, 9), (3.0, 1)]
    assert outstanding_min(t, 0.5, 2.5) == 3
    assert outstanding_min(t, 2.0, 2.9) == 9
