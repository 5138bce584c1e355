"""Tenant fair shares on a saturated engine (engine/fair_share.py), on a stack of its own
with two sequence slots, so that interactive requests queue at the engine worker.

The assertions are on order, not time: which requests the engine started first, as the
client sees their first tokens, and the engine's own /stats."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.e2e.conftest import WAIT_S, make_key, own_stack, vllm_paused
from tests.e2e.test_batch import _sql

pytestmark = pytest.mark.e2e

SLOTS = 2
BACKLOG = 8  # the busy tenant's requests: SLOTS run, the rest wait at the engine worker
PRIORITY_BOUND_S = 1.0


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    # Flex's floor, quick here: one of the two slots once a flex request has waited 0.2 s.
    # Priority's wait bounded (the other tiers' tests here hold requests queued as long as
    # they look): no priority request waits past PRIORITY_BOUND_S for a slot.
    with own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "fair",
                   BALLAST_MAX_NUM_SEQS=str(SLOTS), BALLAST_FLEX_MIN_SHARE="0.5",
                   BALLAST_FLEX_STARVE_AFTER_S="0.2",
                   BALLAST_WAIT_BOUND_PRIORITY_S=str(PRIORITY_BOUND_S)) as stack_and_url:
        yield stack_and_url


async def until(http: httpx.AsyncClient, stack, ready) -> dict:
    """The engine worker's fairness stats, once `ready(stats)`."""
    deadline = time.monotonic() + WAIT_S
    while not ready(fair := (await http.get(stack.engine_url + "/stats", headers=stack.engine_headers)).json()[
            "fairness"]):
        assert time.monotonic() < deadline, fair
        await asyncio.sleep(0.01)
    return fair


def chat(content: str, max_tokens: int) -> dict:
    return dict(model="ballast-tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                temperature=0, ignore_eos=True, stream=True)


async def first_token(http: httpx.AsyncClient, key: str, body: dict, started: dict[str, float], name: str) -> None:
    """Stream the request to its end; note when its first token came."""
    async with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if name in started or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices")
            # A token, not the opening role chunk: its text may be empty (the byte-level
            # model's token can be part of a character), so its first non-empty text
            # would come a step or more after the engine started it.
            if choices and "role" not in choices[0]["delta"] and choices[0]["finish_reason"] is None:
                started[name] = time.monotonic()


def test_a_tenants_short_request_is_served_ahead_of_anothers_backlog(narrow):
    stack, url = narrow
    other = make_key(url, "other")
    assert stack.stats()["fairness"]["mode"] == "vtc"  # the default

    async def run() -> tuple[dict[str, float], dict]:
        started: dict[str, float] = {}
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT_S, limits=limits) as http:
            busy = [asyncio.create_task(first_token(http, stack.key, chat(f"long request {i}", 400), started,
                                                    f"busy-{i}")) for i in range(BACKLOG)]
            # Until the engine worker holds the backlog: SLOTS running (each has a token),
            # the rest waiting there.
            deadline = time.monotonic() + WAIT_S
            while True:
                fair = (await http.get(stack.engine_url + "/stats", headers=stack.engine_headers)).json()["fairness"]
                if fair["waiting"] == {"default": BACKLOG - SLOTS} and len(started) == SLOTS:
                    break
                assert time.monotonic() < deadline, (fair, started)
                await asyncio.sleep(0.01)
            queued_before = set(started)
            # The short request reaches the engine worker's queue with nothing moving, so
            # it meets exactly this backlog however slow the machine is to pass it on.
            with vllm_paused(stack):
                short = asyncio.create_task(first_token(http, other, chat("short", 4), started, "other"))
                await until(http, stack, lambda f: f["waiting"].get("other") == 1)
            await asyncio.gather(short, *busy)
            stats = (await http.get(stack.engine_url + "/stats", headers=stack.engine_headers)).json()["fairness"]
            return {n: t for n, t in started.items() if n not in queued_before}, stats

    started, stats = asyncio.run(run())
    assert "other" in started and len(started) == BACKLOG - SLOTS + 1
    ahead = sorted(n for n, t in started.items() if n.startswith("busy") and t < started["other"])
    # By arrival it would wait behind all BACKLOG - SLOTS queued requests. By fair share
    # it joins level with the busy tenant (VTC's lift; the tie goes to the earlier
    # arrival, so one queued request goes first and is charged its prompt as it is
    # dispatched) and is then the least served: it takes the next slot.
    assert len(ahead) <= 1, (ahead, stats)
    # Both tenants were charged, and nothing is left waiting or running.
    assert stats["counters"]["default"] > stats["counters"]["other"] > 0
    assert stats["running"] == 0 and stats["waiting"] == {} and stats["active"] == []


def test_headroom_starts_another_tenants_request_at_once_beside_a_backlog(narrow):
    """With another tenant about, a backlogged tenant holds at most SLOTS − 1 slots
    (BALLAST_FAIR_HEADROOM, at least one slot): the other's request never waits."""
    stack, url = narrow
    third = make_key(url, "third")

    async def run() -> tuple[dict, dict]:
        started: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT_S, limits=httpx.Limits(max_connections=32)) \
                as http:
            await first_token(http, third, chat("hello", 2), started, "third-seen")  # third is about
            with vllm_paused(stack):
                busy = [asyncio.create_task(first_token(http, stack.key, chat(f"long request {i}", 400), started,
                                                        f"busy-{i}")) for i in range(BACKLOG)]
                before = await until(http, stack, lambda f: f["waiting"] == {"default": BACKLOG - (SLOTS - 1)})
                short = asyncio.create_task(first_token(http, third, chat("short", 4), started, "third"))
                after = await until(http, stack, lambda f: f["running_of"].get("third") == 1)
            await asyncio.gather(short, *busy)  # to their ends: their workflows must not outlive the stack
            return before, after

    before, after = asyncio.run(run())
    # The busy tenant kept a slot free though its requests were waiting …
    assert before["running_of"] == {"default": SLOTS - 1}, before
    # … and third's request took it without ever waiting at the engine worker.
    assert after["queued_by"].get("third", 0) == before["queued_by"].get("third", 0), (before, after)
    assert after["waiting"] == before["waiting"], (before, after)


def test_flex_gets_its_floor_back_under_a_default_backlog(narrow):
    """By tier alone, a flex request waits until no default request is waiting; once it has
    waited BALLAST_FLEX_STARVE_AFTER_S it takes the next free slot (its floor, one of two).
    The API admits it though the engine is busy with chat: flex is below its floor there."""
    stack, _ = narrow

    async def run() -> dict[str, float]:
        started: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT_S, limits=httpx.Limits(max_connections=32)) \
                as http:
            with vllm_paused(stack):
                busy = [asyncio.create_task(first_token(http, stack.key, chat(f"long request {i}", 400), started,
                                                        f"busy-{i}")) for i in range(BACKLOG)]
                before = await until(http, stack, lambda f: sum(f["waiting"].values()) + f["running"] == BACKLOG)
                flex = asyncio.create_task(first_token(http, stack.key, dict(chat("flex please", 4),
                                                                             service_tier="flex"), started, "flex"))
                await until(http, stack, lambda f: sum(f["waiting"].values()) + f["running"] == BACKLOG + 1)
                await asyncio.sleep(0.5)  # flex has waited past BALLAST_FLEX_STARVE_AFTER_S
            await asyncio.gather(flex, *busy)
            assert before["running"] >= 1
        return started

    started = asyncio.run(run())
    after = sorted(n for n, t in started.items() if n.startswith("busy") and t > started["flex"])
    # The default backlog was still waiting when flex went: some of it started after flex.
    assert after, sorted(started.items(), key=lambda kv: kv[1])


def test_a_priority_request_that_would_wait_past_its_bound_is_refused_and_refunded(narrow):
    """Both slots held, one by each of two tenants (vLLM still, so nothing ends): a third
    priority request is refused with a 429 once it would wait, or has waited,
    PRIORITY_BOUND_S for a slot; never accepted, so the ledger refunds all it reserved, and
    the engine counts it."""
    stack, url = narrow
    keys = [make_key(url, "bounded"), make_key(url, "bounded-too")]
    before = stack.stats()["fairness"]
    refused = before["shed_by"].get("priority", 0) + before["expired_by"].get("priority", 0)

    async def run() -> httpx.Response:
        started: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT_S, limits=httpx.Limits(max_connections=8)) \
                as http:
            with vllm_paused(stack):
                held = [asyncio.create_task(first_token(http, key, dict(chat(f"hold {i}", 64), service_tier="priority"),
                                                        started, f"held-{i}")) for i, key in enumerate(keys)]
                await until(http, stack, lambda f: f["running"] == SLOTS)
                third = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {keys[0]}"},
                                        json=dict(chat("third", 4), stream=False, service_tier="priority"))
            await asyncio.gather(*held)
        return third

    third = asyncio.run(run())
    assert third.status_code == 429, third.text
    error = third.json()["error"]
    assert error["code"] == "resource_unavailable" and "the bound on the priority tier's wait" in error["message"]
    after = stack.stats()["fairness"]
    assert after["shed_by"].get("priority", 0) + after["expired_by"].get("priority", 0) == refused + 1
    # The ledger (SQL, not the API's word): the request served settled, the refused one refunded whole.
    deadline = time.monotonic() + WAIT_S
    while (kinds := sorted(k for (k,) in _sql(url, "SELECT kind FROM ledger WHERE tenant = 'bounded'"))) != [
            "refund", "reserve", "reserve", "settle"]:
        assert time.monotonic() < deadline, kinds
        time.sleep(0.2)
