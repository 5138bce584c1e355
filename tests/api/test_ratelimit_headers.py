"""OpenAI's `x-ratelimit-*` headers: every /v1 answer to a tenant's key states where the
tenant stands against its per-minute limits, counted as admission counts them, and only
for the limits it has.

In process, as tests/api/test_admission.py: the `other_api` client (a tenant of its own,
new per test), the real journal and ledger, a fake engine worker that reports 3 prompt
tokens and 1 completion token a request. The oracle is the test's own count: what it sent,
and the usage its responses stated.
"""

from __future__ import annotations

import re
import time

import openai
import pytest
from sqlalchemy import text

from api.ratelimit_headers import duration
from tests.api import test_admission
from tests.api.conftest import assert_openai_error
from tests.api.test_admission import CHAT, MODEL, body, fresh_window

harness = test_admission.harness  # its fixture: the tenant's client, a fake engine, the real ledger

NAMES = {f"x-ratelimit-{k}-{d}" for k in ("limit", "remaining", "reset") for d in ("requests", "tokens")}


def stated(r) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}


def seconds(d: str) -> float:
    """A Go duration back to seconds (what the client would parse)."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?(?:(\d+)ms)?", d)
    assert parts is not None and d, d
    h, m, s, ms = (float(p) if p else 0.0 for p in parts.groups())
    return 3600 * h + 60 * m + s + ms / 1000


def left_in_minute() -> float:
    return 60 - time.time() % 60


@pytest.mark.parametrize("s, want", [(0, "0s"), (0.017, "17ms"), (0.9991, "1s"), (1, "1s"), (59.5, "59.5s"),
                                     (60, "1m0s"), (360, "6m0s"), (3725.25, "1h2m5.25s")])
def test_resets_are_written_as_go_durations(s, want):
    assert duration(s) == want and seconds(want) == pytest.approx(s, abs=1e-3)


async def test_each_answer_states_the_limits_less_what_the_tenant_sent(harness):
    await harness.limit(requests_per_min=20, input_tokens_per_min=1000)
    await fresh_window(need_s=15)
    sent, prompt_tokens = 0, 0
    for _ in range(4):
        r = await harness.chat(tier="priority")
        assert r.status_code == 200, r.text
        sent, prompt_tokens = sent + 1, prompt_tokens + r.json()["usage"]["prompt_tokens"]
        h = stated(r)
        assert set(h) == NAMES
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("20", str(20 - sent))
        assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("1000",
                                                                                      str(1000 - prompt_tokens))
        for k in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
            assert abs(seconds(h[k]) - left_in_minute()) < 1.0, h
    # Routes that admit nothing state the same, and count nothing themselves.
    for path in ("/v1/files", "/v1/batches", "/v1/models"):
        h = stated(await harness.client.get(path))
        assert h["x-ratelimit-remaining-requests"] == str(20 - sent), path
        assert h["x-ratelimit-remaining-tokens"] == str(1000 - prompt_tokens), path
    # A streamed answer counts itself before its first token.
    async with harness.client.stream("POST", CHAT, json=body(tier="priority", stream=True)) as r:
        assert r.status_code == 200
        assert stated(r)["x-ratelimit-remaining-requests"] == str(20 - sent - 1)
        async for _ in r.aiter_bytes():
            pass


async def test_the_official_client_reads_them(harness):
    await harness.limit(requests_per_min=7)
    await fresh_window()
    key = harness.client.headers["Authorization"][7:]
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=key, max_retries=0,
                                  http_client=harness.client) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[dict(role="user", content="hi")], max_tokens=5)
        assert raw.parse().usage is not None
        assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == ("7", "6")
        assert "x-ratelimit-limit-tokens" not in raw.headers  # it has no token limit


async def test_a_429_keeps_retry_after_and_states_none_remaining(harness):
    await harness.limit(requests_per_min=2)
    await fresh_window()
    assert [(await harness.chat(tier="priority")).status_code for _ in range(2)] == [200, 200]
    r = await harness.chat(tier="priority")
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    h = stated(r)
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "0")
    assert abs(seconds(h["x-ratelimit-reset-requests"]) - int(r.headers["Retry-After"])) <= 1.0


async def test_a_tenant_without_limits_gets_no_such_headers(harness):
    await harness.limit(concurrent_requests=5, tokens_per_day=10**6)  # limits, none per minute
    assert stated(await harness.chat()) == {}
    assert stated(await harness.client.get("/v1/files")) == {}


async def test_output_tokens_stand_in_for_tokens_where_input_has_no_limit(harness):
    await harness.limit(output_tokens_per_min=500)
    await fresh_window()
    used = 0
    for _ in range(3):
        r = await harness.chat(tier="priority")
        used += r.json()["usage"]["completion_tokens"]
    h = stated(r)
    assert "x-ratelimit-limit-requests" not in h
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("500", str(500 - used))


async def test_the_limit_that_refuses_first_is_the_one_stated(harness):
    await harness.limit("*", requests_per_min=100)
    await harness.limit(MODEL, requests_per_min=5)
    await harness.limit("other-model", requests_per_min=3)
    await fresh_window()
    h = stated(await harness.chat(tier="priority"))
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("5", "4")
    # No model named: every limit the tenant has, and the other model's, unused, is tighter.
    h = stated(await harness.client.get("/v1/files"))
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("3", "3")


async def test_sync_admission_states_the_ledgers_count(harness, db):
    harness.admission.mode = "sync"
    await harness.limit(requests_per_min=10, input_tokens_per_min=10_000)
    await fresh_window()
    for sent in range(1, 4):
        h = stated(await harness.chat(tier="priority"))
        assert h["x-ratelimit-remaining-requests"] == str(10 - sent)
    async with db.connect() as conn:  # sync mode reserves in the deciding transaction
        reserved = (await conn.execute(text(
            "SELECT coalesce(sum(input_tokens), 0) FROM ledger WHERE tenant = :t AND kind = 'reserve' "
            "AND at >= date_trunc('minute', now())"), dict(t=harness.tenant))).scalar_one()
    assert h["x-ratelimit-remaining-tokens"] == str(10_000 - reserved)
    h = stated(await harness.client.get("/v1/files"))  # read from the ledger once, then kept
    assert h["x-ratelimit-remaining-requests"] == "7" and h["x-ratelimit-remaining-tokens"] == str(10_000 - reserved)
