"""The Virtual Token Counter (policy/fairness.py) and its engine shell (engine/fair_share.py)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

import pytest

from engine.fair_share import FairShare
from policy import fairness as f
from protocol.tiers import RANK
from tests.helpers import Clock


def test_charge_weights_tokens_and_divides_by_weight():
    v = f.charge(f.Vtc(), "a", input_tokens=10, output_tokens=5)
    assert v.counter("a") == 20  # 10 × 1 + 5 × 2
    v = f.charge(v, "b", input_tokens=10, output_tokens=5, weight=2)
    assert v.counter("b") == 10
    assert f.charge(v, "a", input_tokens=1, cost=f.Cost(input=3)).counter("a") == 23


def test_activation_lifts_to_the_least_active_counter_so_idling_banks_no_credit():
    v = f.activate(f.activate(f.Vtc(), "a"), "b")
    v = f.charge(f.charge(v, "a", input_tokens=1000), "b", input_tokens=400)
    v = f.deactivate(v, "b")  # b idles while a is served on
    v = f.charge(v, "a", input_tokens=5000)
    v = f.activate(v, "b")
    assert v.counter("b") == v.counter("a") == 6000
    # Never lowered: a tenant ahead stays ahead.
    v = f.charge(v, "b", input_tokens=100)
    v = f.deactivate(v, "b")
    assert f.activate(v, "b").counter("b") == 6100
    # The engine idle: lifted to the last tenant that left.
    v = f.deactivate(v, "a")
    assert f.activate(v, "c").counter("c") == 6000
    assert f.activate(v, "c") == f.activate(f.activate(v, "c"), "c")  # idempotent


def test_rank_is_distance_from_the_least_served_active_tenant_in_quanta():
    v = f.activate(f.activate(f.Vtc(), "a"), "b")
    v = f.charge(v, "a", input_tokens=1000)
    assert f.rank(v, "b", 256) == 0
    assert f.rank(v, "a", 256) == 3
    assert f.rank(f.deactivate(v, "b"), "a", 256) == 0


def test_pick_prefers_tier_then_least_counter_then_arrival():
    v = f.charge(f.activate(f.activate(f.Vtc(), "a"), "b"), "a", input_tokens=50)
    heads = [f.Head("a", "default", 0), f.Head("b", "default", 5)]
    assert f.pick(v, heads) == f.Head("b", "default", 5)
    assert f.pick(v, [*heads, f.Head("a", "priority", 9)]) == f.Head("a", "priority", 9)
    assert f.pick(v, [f.Head("c", "flex", 1), f.Head("d", "flex", 0)]) == f.Head("d", "flex", 0)
    assert f.pick(v, []) is None


@pytest.mark.parametrize("span", [1, 4, 16])
def test_every_tier_precedes_the_next_for_any_rank_and_batch_stays_last(span):
    order = sorted(RANK, key=RANK.__getitem__)  # priority, default, flex, batch
    ranks = [0, 1, span - 1, span, 10**9]
    for hi, lo in zip(order, order[1:], strict=False):
        assert max(f.engine_priority(hi, r, span) for r in ranks) < min(f.engine_priority(lo, r, span) for r in ranks)
    for tier in order[:-1]:
        got = [f.engine_priority(tier, r, span) for r in range(span + 2)]
        assert got == sorted(got) and len(set(got)) == min(span, len(got))
        assert all(p != RANK["batch"] for p in got)
    assert {f.engine_priority("batch", r, span) for r in ranks} == {RANK["batch"]}


def _serve(sizes: dict[str, tuple[int, int]], slots: int, steps: int, seed: int) -> tuple[float, float]:
    """A discrete engine: `slots` sequences, one output token per running request per step;
    every tenant backlogged; VTC's pick on each free slot. The counters' largest gap over the
    run, and the bound 2 × the largest request's cost."""
    rng = random.Random(seed)
    v = f.Vtc()
    for t in sorted(sizes):
        v = f.activate(v, t)
    running: list[list] = []  # [tenant, tokens left]
    seq, gap = 0, 0.0
    for _ in range(steps):
        while len(running) < slots:
            head = f.pick(v, [f.Head(t, "default", seq + i) for i, t in enumerate(sorted(sizes))])
            assert head is not None
            tenant = head.tenant
            seq += len(sizes)
            p, out = sizes[tenant]
            p, out = rng.randint(1, p), rng.randint(1, out)
            v = f.charge(v, tenant, input_tokens=p)
            running.append([tenant, out])
        for r in running:
            v = f.charge(v, r[0], output_tokens=1)
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
        cs = [v.counter(t) for t in sizes]
        gap = max(gap, max(cs) - min(cs))
    largest = max(p * 1 + out * 2 for p, out in sizes.values())
    return gap, 2 * largest


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("slots", [1, 4, 8])
def test_two_backlogged_tenants_counters_stay_within_the_bound(seed, slots):
    # One tenant's requests are 10× the other's, input and output.
    gap, bound = _serve({"a": (40, 20), "b": (400, 200)}, slots, 3000, seed)
    assert gap <= bound, (gap, bound)


def test_counting_requests_instead_would_break_the_bound():
    # The same engine picking round-robin by request count: the gap grows without bound.
    v = f.Vtc()
    for i in range(200):
        v = f.charge(v, "a", input_tokens=40, output_tokens=20)
        v = f.charge(v, "b", input_tokens=400, output_tokens=200)
        if i > 10:
            assert v.counter("b") - v.counter("a") > 2 * (400 + 400)


# -- the engine shell ---------------------------------------------------------------


def test_shell_dispatches_least_served_tenant_when_a_slot_frees():
    async def run() -> list[str]:
        share = FairShare("vtc", limit=1)
        order: list[str] = []
        release = asyncio.Event()

        async def request(tenant: str, prompt: int, hold: asyncio.Event | None = None):
            async with share.turn(tenant, "default", 1, prompt, 1) as turn:
                order.append(tenant)
                turn.produced(prompt)
                if hold is not None:
                    await hold.wait()

        first = asyncio.create_task(request("big", 1000, release))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(request("big", 1000)) for _ in range(3)]
        await asyncio.sleep(0)
        small = asyncio.create_task(request("small", 10))
        await asyncio.sleep(0)
        assert share.snapshot()["waiting"] == {"big": 3, "small": 1}
        release.set()
        await asyncio.gather(first, small, *queued)
        assert share.running == 0 and share.waiting == 0 and not share.state.active
        return order

    # small joins level with big (lifted to the least active counter: a tie, big arrived
    # first), then is ahead of big's backlog as soon as big has been served once more;
    # by arrival it would have come last.
    assert asyncio.run(run()) == ["big", "big", "small", "big", "big"]


def test_shell_fcfs_passes_the_api_priority_and_never_waits():
    async def run():
        share = FairShare("fcfs", limit=1)
        async with share.turn("a", "default", 1, 5, 1) as t1, share.turn("b", None, 1, 5, 2) as t2:
            assert (t1.priority, t2.priority) == (1, 2)
        assert share.snapshot()["counters"] == {"a": 5.0, "b": 5.0}  # counted, no lifts

    asyncio.run(run())


def test_shell_tier_precedes_fair_share_and_cancelled_waiters_give_their_turn_back():
    async def run():
        share = FairShare("vtc", limit=1)
        hold = asyncio.Event()
        order: list[tuple[str, str]] = []

        async def request(tenant: str, tier: str, wait: asyncio.Event | None = None):
            async with share.turn(tenant, tier, 1, 1, RANK[tier]) as turn:
                order.append((tenant, tier))
                assert turn.priority == f.engine_priority(tier, 0) or tier == "default"
                if wait is not None:
                    await wait.wait()

        first = asyncio.create_task(request("a", "default", hold))
        await asyncio.sleep(0)
        gone = asyncio.create_task(request("b", "priority"))
        flex = asyncio.create_task(request("b", "flex"))
        prio = asyncio.create_task(request("c", "priority"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        hold.set()
        await asyncio.gather(first, flex, prio)
        assert gone.cancelled()
        assert order == [("a", "default"), ("c", "priority"), ("b", "flex")]
        assert share.running == 0 and share.waiting == 0 and share.load == {} and share.queued_of == {}

    asyncio.run(run())


def test_shell_charges_the_prompt_at_dispatch_so_slots_freed_together_go_to_different_tenants():
    async def run() -> list[str]:
        share = FairShare("vtc", limit=2)
        release = asyncio.Event()
        order: list[str] = []

        async def request(name: str, tenant: str, hold: asyncio.Event | None = None):
            async with share.turn(tenant, "default", 1, 100, 1):
                order.append(name)
                if hold is not None:
                    await hold.wait()

        running = [asyncio.create_task(request(f"busy-{i}", "busy", release)) for i in range(2)]
        await asyncio.sleep(0)
        queued = [asyncio.create_task(request(f"busy-{i}", "busy")) for i in range(2, 6)]
        await asyncio.sleep(0)
        other = asyncio.create_task(request("other", "other"))
        await asyncio.sleep(0)
        release.set()  # both slots free in the same instant
        await asyncio.gather(*running, *queued, other)
        return order

    order = asyncio.run(run())
    assert order.index("other") == 3  # one queued busy request (the tie, by arrival), then other


def test_shell_a_waiter_cancelled_after_its_grant_gives_the_slot_back():
    async def run():
        share = FairShare("vtc", limit=1)
        hold = asyncio.Event()

        async def request(tenant: str, wait: asyncio.Event | None = None):
            async with share.turn(tenant, "default", 1, 1, 1):
                if wait is not None:
                    await wait.wait()

        first = asyncio.create_task(request("a", hold))
        await asyncio.sleep(0)
        second = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.sleep(0)  # first ends and grants b its turn …
        assert share.running == 1 and share.waiting == 0
        second.cancel()  # … which b never takes
        await asyncio.gather(first, second, return_exceptions=True)
        assert share.running == 0 and share.waiting == 0 and share.load == {} and share.queued_of == {}
        async with share.turn("c", "default", 1, 1, 1):  # the slot is free again
            assert share.running == 1

    asyncio.run(run())



def test_pick_skips_capped_tenants_and_puts_starved_tiers_first():
    v = f.activate(f.activate(f.Vtc(), "a"), "b")
    heads = [f.Head("a", "default", 0), f.Head("b", "flex", 1)]
    assert f.pick(v, heads).tenant == "a"  # tier first
    assert f.pick(v, heads, first=frozenset({"flex"})).tenant == "b"  # a starved tier before any other
    assert f.pick(v, heads, capped=frozenset({"a"})).tenant == "b"
    assert f.pick(v, heads, capped=frozenset({"a", "b"})) is None
    assert f.tenant_cap(8, 1, others=False) == 8 and f.tenant_cap(8, 1, others=True) == 7
    assert f.tenant_cap(1, 1, others=True) == 1  # never below one slot


def test_shell_headroom_lets_another_tenant_start_at_once_beside_a_backlog():
    async def run():
        clock = Clock()
        share = FairShare("vtc", limit=4, headroom=1, recent_s=60, clock=clock)
        hold = asyncio.Event()
        started: list[str] = []

        async def request(tenant: str, wait: asyncio.Event | None = None):
            async with share.turn(tenant, "default", 1, 2000, 1):
                started.append(tenant)
                await (wait or hold).wait()

        # 1. alone, the giant tenant may take every slot
        giants = [asyncio.create_task(request("giant")) for _ in range(6)]
        await asyncio.sleep(0)
        assert share.running_of == {"giant": 4} and share.waiting == 2
        # 2. another tenant arrives: no slot is free, it waits for the next one to free …
        chat_done = asyncio.Event()
        chat = asyncio.create_task(request("chat", chat_done))
        await asyncio.sleep(0)
        assert started.count("chat") == 0
        # … which goes to it (least served); from now on giant keeps one slot free
        first = giants[0]
        share_hold, hold_new = hold, asyncio.Event()
        hold = hold_new  # the giants still waiting will block on the new event
        share_hold.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert "chat" in started and first.done()
        chat_done.set()
        await chat
        # 3. chat has left, but was seen within recent_s: giant holds at most 3
        await asyncio.sleep(0)
        assert share.running_of.get("giant", 0) <= 3
        again = asyncio.Event()
        second = asyncio.create_task(request("chat", again))
        await asyncio.sleep(0)
        assert started.count("chat") == 2, "a free slot was kept: the second chat request started at once"
        again.set()
        await second
        # 4. once the other tenant has not been seen for recent_s, the headroom lapses
        clock.now += 61
        extra = asyncio.create_task(request("giant"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.gather(*giants, extra)
        assert share.running == 0 and share.waiting == 0 and share.running_of == {} and share.running_in == {}

    asyncio.run(run())


def test_shell_flex_gets_its_floor_back_after_waiting_starve_after_s():
    async def run():
        clock = Clock()
        share = FairShare("vtc", limit=2, floors=dict(flex=1), starve_after_s=30, clock=clock)
        order: list[str] = []
        releases: list[asyncio.Event] = []

        async def request(tier: str):
            gate = asyncio.Event()
            releases.append(gate)
            async with share.turn("t", tier, 1, 1, RANK[tier]):
                order.append(tier)
                await gate.wait()

        tasks = [asyncio.create_task(request("default")) for _ in range(2)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(request("flex")))
        tasks += [asyncio.create_task(request("default")) for _ in range(3)]
        await asyncio.sleep(0)

        async def free_one(i: int):
            releases[i].set()
            for _ in range(3):
                await asyncio.sleep(0)

        await free_one(0)  # flex has not waited long: the default backlog goes first
        assert order == ["default"] * 3
        clock.now += 30
        await free_one(1)  # starved below its floor: flex goes before the default backlog
        assert order == ["default"] * 3 + ["flex"]
        for g in releases:
            g.set()
        await asyncio.sleep(0)
        for g in releases:
            g.set()
        await asyncio.gather(*tasks)
        assert order.count("default") == 5 and share.waiting == 0

    asyncio.run(run())


def test_shell_served_excludes_lifts_and_out_of_turn_counts_work_conserving_grants():
    async def run():
        share = FairShare("vtc", limit=2)
        hold_a, hold_b = asyncio.Event(), asyncio.Event()

        async def request(tenant: str, prompt: int, hold: asyncio.Event):
            async with share.turn(tenant, "default", 1, prompt, 1):
                await hold.wait()

        a = asyncio.create_task(request("a", 100, hold_a))
        await asyncio.sleep(0)
        b = asyncio.create_task(request("b", 10, hold_b))  # lifted to a's 100 on arrival …
        await asyncio.sleep(0)
        snap = share.snapshot()
        assert snap["counters"] == {"a": 100.0, "b": 110.0}
        assert snap["served"] == {"a": 100.0, "b": 10.0}  # … which is not service
        # b (110) is ahead of a (100), and a has nothing waiting: b's next grant is out of turn
        hold_b.set()
        await b
        b2 = asyncio.create_task(request("b", 10, asyncio.Event()))
        await asyncio.sleep(0)
        assert share.snapshot()["out_of_turn"] == {"b": 1}  # its first came level with a (a tie): in turn
        hold_a.set()
        await a
        b2.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b2

    asyncio.run(run())


def test_shell_one_long_prompt_prefills_at_a_time_while_another_tenant_is_about():
    async def run():
        share = FairShare("vtc", limit=8, long_prompt=512, long_prefills=1)
        first_token: dict[str, asyncio.Event] = {}
        started: list[str] = []

        async def request(name: str, tenant: str, prompt: int):
            first_token[name] = asyncio.Event()
            async with share.turn(tenant, "default", 1, prompt, 1) as turn:
                started.append(name)
                await first_token[name].wait()
                turn.produced(1)  # the prefill is over
                await asyncio.sleep(0)

        # alone, a tenant's long prompts all start at once
        alone = [asyncio.create_task(request(f"solo-{i}", "giant", 2000)) for i in range(2)]
        await asyncio.sleep(0)
        assert started == ["solo-0", "solo-1"] and share.prefilling_long == 2
        for i in range(2):
            first_token[f"solo-{i}"].set()
        await asyncio.gather(*alone)
        # with another tenant about, one long prompt prefills at a time; short ones pass
        chat0 = asyncio.create_task(request("chat-0", "chat", 50))  # the chat tenant is about
        await asyncio.sleep(0)
        first_token["chat-0"].set()
        await chat0
        started.clear()
        giants = [asyncio.create_task(request(f"giant-{i}", "giant", 2000)) for i in range(3)]
        await asyncio.sleep(0)
        chat = asyncio.create_task(request("chat-1", "chat", 50))
        await asyncio.sleep(0)
        assert started == ["giant-0", "chat-1"] and share.snapshot()["waiting"] == {"giant": 2}
        first_token["giant-0"].set()  # its prefill is over: the next long prompt starts
        for _ in range(3):
            await asyncio.sleep(0)
        assert started[-1] == "giant-1" and share.prefilling_long == 1
        for name in ("chat-1", "giant-1"):
            first_token[name].set()
        for _ in range(3):
            await asyncio.sleep(0)
        first_token["giant-2"].set()
        await asyncio.gather(*giants, chat)
        assert share.prefilling_long == 0 and share.running == 0 and share.waiting == 0

    asyncio.run(run())


def test_reservations_split_over_the_pool_and_hold_back_only_what_is_unused():
    from policy import reservations as r

    # 5 slots over 3 engines: 2, 2, 1 by id; an engine the list has not seen yet counts too.
    assert [r.share(5, ["e1", "e2", "e3"], e) for e in ("e1", "e2", "e3")] == [2, 2, 1]
    assert r.share(5, ["e2"], "e1") == 3 and r.share(0, ["e1"], "e1") == 0
    anywhere = {"e1": "eu", "e2": "eu", "e3": "us"}
    assert r.shares([r.Reserved("gold", 5), r.Reserved("tin", 1)], anywhere, "e3") == {"gold": 1}
    # A regional reservation is split over its region's engines alone, and adds to one anywhere.
    eu = [r.Reserved("gold", 3, "eu"), r.Reserved("gold", 5)]
    assert [r.shares(eu, anywhere, e) for e in ("e1", "e2", "e3")] == [{"gold": 2 + 2}, {"gold": 1 + 2}, {"gold": 1}]
    assert r.shares([r.Reserved("tin", 4, "ap")], anywhere, "e1") == {}
    # A draining engine is no peer of the others, nor holds any part itself.
    draining_e3 = {"e1": "eu", "e2": "eu"}
    assert [r.shares([r.Reserved("gold", 5)], draining_e3, e) for e in ("e1", "e2", "e3")] == [
        {"gold": 3}, {"gold": 2}, {}]
    reserved, running = {"gold": 3, "silver": 2}, {"gold": 1, "silver": 4, "x": 9}
    assert r.unused(reserved, running) == {"gold": 2}
    assert (r.held_back(reserved, running, "x"), r.held_back(reserved, running, "gold")) == (2, 0)
    assert r.within(reserved, running, "gold") and not r.within(reserved, running, "silver")


def test_pick_puts_heads_inside_their_reservation_first_even_when_capped():
    v = f.charge(f.activate(f.activate(f.Vtc(), "gold"), "b"), "gold", input_tokens=10_000)
    heads = [f.Head("b", "priority", 0), f.Head("gold", "flex", 5)]
    assert f.pick(v, heads, reserved=frozenset({"gold"}), capped=frozenset({"gold"})) == f.Head("gold", "flex", 5)
    assert f.pick(v, heads) == f.Head("b", "priority", 0)


def test_shell_a_reservation_is_kept_free_of_others_and_taken_at_once_at_the_top_priority():
    async def run():
        share = FairShare("vtc", limit=4)
        share.reserve({"gold": 2})
        hold = asyncio.Event()
        started: list[tuple[str, int]] = []

        async def request(tenant: str, tier: str = "default", wait: asyncio.Event | None = None):
            async with share.turn(tenant, tier, 1, 10, 1) as turn:
                started.append((tenant, turn.priority))
                await (wait or hold).wait()

        # 1. another tenant's backlog takes the 2 shared slots, never gold's 2
        others = [asyncio.create_task(request("b", "priority")) for _ in range(5)]
        await asyncio.sleep(0)
        assert share.running_of == {"b": 2} and share.waiting == 3
        # 2. gold's requests start at once, ahead of b's waiting priority ones, at the top priority
        gold_done = asyncio.Event()
        golds = [asyncio.create_task(request("gold", "flex", gold_done)) for _ in range(3)]
        await asyncio.sleep(0)
        assert share.running_of == {"b": 2, "gold": 2}
        top = f.engine_priority("priority")
        assert [p for t, p in started if t == "gold"] == [top, top]
        # its third is beyond the reservation: shared, behind b's priority backlog
        assert share.snapshot()["waiting"] == {"b": 3, "gold": 1}
        # 3. gold's requests end (its third went inside the reservation as the first two
        #    left): its slots are held back again, b's backlog takes neither
        gold_done.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert all(g.done() for g in golds) and [t for t, _ in started].count("gold") == 3
        assert share.running_of == {"b": 2} and share.waiting == 3
        # 4. the reservation withdrawn: b takes every slot
        share.reserve({})
        await asyncio.sleep(0)
        assert share.running == 4
        hold.set()
        await asyncio.gather(*others, *golds)
        assert share.running == 0 and share.waiting == 0

    asyncio.run(run())


def test_shell_tells_the_slots_what_its_reservations_leave_unused_as_it_changes():
    async def run():
        share = FairShare("vtc", limit=4)
        told: list[tuple[int, int]] = []

        async def lend(n: int, taken: int) -> None:
            told.append((n, taken))

        share.lending = lend
        share.reserve({"gold": 2})
        hold = asyncio.Event()

        async def request(tenant: str):
            async with share.turn(tenant, "default", 1, 10, 1):
                await hold.wait()

        tasks = [asyncio.create_task(request("gold")) for _ in range(3)] + [asyncio.create_task(request("b"))]
        for _ in range(3):
            await asyncio.sleep(0)
        hold.set()
        await asyncio.gather(*tasks)
        for _ in range(3):
            await asyncio.sleep(0)
        # 2 unused; 1, then 0 as gold's requests take them (its third and b's change nothing);
        # back to 2 as they end
        assert told == [(2, 0), (1, 1), (0, 2), (1, 1), (2, 0)]

    asyncio.run(run())


def test_a_steps_tokens_count_toward_the_rate_at_full_load_only_when_vllm_ran_full():
    from engine.vllm_engine import Load, record_step

    load = Load()
    for running, since, now, tokens in ((3, 0.0, 0.1, 3), (4, 0.1, 0.25, 4), (5, 0.25, 0.35, 5), (2, 0.35, 0.4, 2)):
        load.running = running  # as of the step before: the one the interval was stepped at
        record_step(load, 4, since, now, tokens)
    assert load.full_tokens == 4 + 5 and abs(load.full_s - (0.15 + 0.10)) < 1e-9
    record_step(load, 0, 0.4, 9.0, 100)  # no threshold: nothing counts
    assert load.full_tokens == 9


# -- the bound on the wait ---------------------------------------------------------------------


def test_expected_wait_is_the_requests_ahead_times_a_hold_over_the_slots_and_past_the_bound_is_shed():
    assert f.expected_wait(ahead=0, slots=4, hold_s=8.0) == 2.0  # the first of 4 slots to free: a quarter hold
    assert f.expected_wait(ahead=7, slots=4, hold_s=8.0) == 16.0  # the 8th to free: two holds
    assert f.shed(16.0, 15.0) == 1 and f.shed(16.0, 10.0) == 6 and f.shed(16.2, 10.0) == 7
    # the classes before it arriving at 0.25 a second take half of the 0.5 a second that free
    assert f.expected_wait(ahead=3, slots=4, hold_s=8.0, before_rate=0.25) == 16.0
    assert f.expected_wait(ahead=0, slots=4, hold_s=8.0, before_rate=0.5) == math.inf
    assert f.shed(math.inf, 10.0) == f.MAX_RETRY_S
    assert f.shed(15.0, 15.0) is None  # at the bound it queues
    # a tier with a floor of 2 slots: back after 5 s starved, then 2 a hold (8 s) for its own 3 ahead
    assert f.floor_wait(ahead=3, floor=2, hold_s=8.0, after_s=5.0) == 21.0
    assert f.floor_wait(ahead=3, floor=0, hold_s=8.0, after_s=5.0) == math.inf
    assert f.shed(600.0, 0.0) is None  # no bound


def test_shell_refuses_a_request_whose_expected_wait_passes_its_tiers_bound_and_never_a_reserved_one():
    async def run():
        clock = Clock()
        share = FairShare("vtc", limit=2, bounds=dict(priority=30, default=10, flex=5), clock=clock)
        gates: list[asyncio.Event] = []

        async def request(tenant: str, tier: str):
            gate = asyncio.Event()
            gates.append(gate)
            async with share.turn(tenant, tier, 1, 10, RANK[tier]):
                await gate.wait()

        # 1. each request's hold, from its grant to its end, measured
        for _ in range(8):
            t = asyncio.create_task(request("a", "default"))
            await asyncio.sleep(0)
            clock.now += 4.0
            gates[-1].set()
            await t
        assert share.hold_s() == 4.0
        # 2. a free slot: no wait
        assert share.expected_wait("b", "flex") == 0.0 and share.over_bound("b", "flex") is None
        # 3. both slots held, 5 default requests waiting: each ahead is half a hold (2 s)
        running = [asyncio.create_task(request("a", "default")) for _ in range(2)]
        await asyncio.sleep(0)
        assert share.expected_wait("b", "default") == 2.0
        waiting = [asyncio.create_task(request("a", "default")) for _ in range(5)]
        await asyncio.sleep(0)
        assert share.waiting == 5
        assert share.expected_wait("b", "default") == 12.0 and share.over_bound("b", "default") == 2
        # flex: besides the queue, default requests arrived at 0.9 a second over the last
        # 10 s (9 of them), more than the 0.5 a second that slots free: nothing is left for it
        assert share.expected_wait("b", "flex") == math.inf and share.over_bound("b", "flex") == f.MAX_RETRY_S
        # priority goes before the default backlog: only its own tier is ahead of it
        assert share.expected_wait("b", "priority") == 2.0 and share.over_bound("b", "priority") is None
        assert share.snapshot()["shed_by"] == {"default": 1, "flex": 1} and share.snapshot()["hold_s"] == 4.0
        # 4. a tenant inside its reservation starts at its slot's next freeing, whatever waits
        share.reserve({"gold": 1})
        assert share.expected_wait("gold", "flex") == 0.0 and share.over_bound("gold", "flex") is None
        share.reserve({})
        for g in gates:
            g.set()
        for _ in range(4):
            await asyncio.sleep(0)
            for g in gates:
                g.set()
        await asyncio.gather(*running, *waiting)
        assert share.running == 0 and share.waiting == 0

    asyncio.run(run())


def test_shell_fcfs_keeps_no_queue_so_bounds_nothing():
    share = FairShare("fcfs", limit=1, bounds=dict(default=0.001))
    share.holds.extend([60.0] * 8)
    assert share.expected_wait("a", "default") is None and share.over_bound("a", "default") is None


def holding(share: FairShare):
    """(gate, request): each `request()` a default one of tenant a, holding its slot until the gate is set."""
    gate = asyncio.Event()

    async def request():
        async with share.turn("a", "default", 1, 10, RANK["default"]):
            await gate.wait()

    return gate, request


def test_shell_refuses_nothing_for_the_wait_until_eight_holds_are_measured():
    async def run():
        share = FairShare("vtc", limit=1, bounds=dict(default=1))
        gate, request = holding(share)
        tasks = [asyncio.create_task(request()) for _ in range(4)]
        await asyncio.sleep(0)
        share.holds.extend([60.0] * 7)
        assert share.expected_wait("b", "default") is None and share.over_bound("b", "default") is None
        share.holds.append(60.0)
        assert share.expected_wait("b", "default") == 240.0 and share.over_bound("b", "default") == f.MAX_RETRY_S
        gate.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_shell_a_request_that_waits_its_tiers_bound_is_refused_then_and_leaves_the_queue():
    from engine.fair_share import WaitedPastBound

    async def run():
        share = FairShare("vtc", limit=1, bounds=dict(default=0.05))
        gate, request = holding(share)
        running = asyncio.create_task(request())
        await asyncio.sleep(0)
        with pytest.raises(WaitedPastBound, match="waited 0.05 s"):
            await request()
        assert share.waiting == 0 and share.queues == {} and share.snapshot()["expired_by"] == {"default": 1}
        gate.set()
        await running
        assert share.running == 0

    asyncio.run(run())


def test_shell_flex_under_continuous_chat_waits_at_most_its_floors_pace():
    async def run():
        share = FairShare("vtc", limit=2, floors=dict(flex=1), starve_after_s=5, bounds=dict(flex=10))
        share.holds.extend([2.0] * 8)
        gate, request = holding(share)
        # default requests arriving faster than the slots free: by tier alone flex never gets one
        tasks = [asyncio.create_task(request()) for _ in range(12)]
        await asyncio.sleep(0)
        assert share.waiting == 10 and share.arrived == {1: 12}  # 1.2 a second against 1 a second freed
        # its floor comes back after 5 s and serves a flex request a hold (2 s)
        assert share.expected_wait("b", "flex") == 7.0 and share.over_bound("b", "flex") is None

        async def flex_request():
            async with share.turn("b", "flex", 1, 10, RANK["flex"]):
                await gate.wait()

        flex = [asyncio.create_task(flex_request()) for _ in range(2)]  # 2 flex waiting: 5 s + 3 holds
        await asyncio.sleep(0)
        assert share.expected_wait("b", "flex") == 11.0 and share.over_bound("b", "flex") == 1
        gate.set()
        for _ in range(8):
            await asyncio.sleep(0)
            gate.set()
        await asyncio.gather(*tasks, *flex)
        assert share.running == 0 and share.waiting == 0

    asyncio.run(run())
