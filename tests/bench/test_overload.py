"""`bench overload`'s tally, on outcomes worked out by hand."""

from __future__ import annotations

from bench.overload import Outcome, tally


def test_the_tally_counts_each_tenants_outcomes_and_waits_of_those_served_only():
    outcomes = [
        Outcome("a", 200, ttft=0.010), Outcome("a", 200, ttft=0.030), Outcome("a", 429, "resource_unavailable"),
        Outcome("a", 429, "rate_limit_exceeded"), Outcome("a", 429, "resource_unavailable"),
        Outcome("a", 500, "internal_error"), Outcome("a", 200),  # served, but no first token: failed
        Outcome("b", 200, ttft=1.0, downgraded=True), Outcome("b", 0, "ConnectError"),
    ]
    got = tally(outcomes)
    assert got["a"] == dict(sent=7, served=2, refused={"resource_unavailable": 2, "rate_limit_exceeded": 1},
                            failed=2, downgraded=0, ttft_p50_ms=10.0, ttft_p99_ms=30.0)  # nearest rank
    assert got["b"] == dict(sent=2, served=1, refused={}, failed=1, downgraded=1, ttft_p50_ms=1000.0,
                            ttft_p99_ms=1000.0)
    assert tally([Outcome("c", 429, "x")])["c"]["ttft_p50_ms"] is None


def test_a_refusal_for_the_wait_is_told_from_flex_shed_for_capacity():
    import asyncio
    import json

    import httpx

    from bench.overload import WAIT, _chat

    def answer(request: httpx.Request) -> httpx.Response:
        tier = json.loads(request.content)["service_tier"]
        message = ("Every engine serving 'm' is full, and the requests queued ahead of this one would keep it waiting "
                   "past the bound on the default tier's wait; try again in 3 s." if tier == "default"
                   else "The fleet is busy: flex requests are refused until it is not.")
        return httpx.Response(429, json=dict(error=dict(message=message, type="rate_limit_error", param=None,
                                                        code="resource_unavailable")))

    async def both():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://api.test") as http:
            return await _chat(http, "std", "k", "hi", 4), await _chat(http, "cheap", "k", "hi", 4)

    std, cheap = asyncio.run(both())
    assert (std.status, std.code) == (429, WAIT) and (cheap.status, cheap.code) == (429, "resource_unavailable")
