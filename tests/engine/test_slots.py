"""EngineSlots, the engine worker's side of preemption, with a fake clock and fake aborts
(on real vLLM: tests/e2e/test_preemption.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from engine.slots import EngineSlots
from tests.helpers import Clock


async def hold(slots: EngineSlots, id: str, tier: int, aborted: list[str], started: asyncio.Event):
    async def abort():
        aborted.append(id)

    async with slots.batch(id, tier, abort) as h:
        started.set()
        await h.preempted.wait()


async def start_batch(slots, ids, clock, aborted):
    tasks = []
    for i, id in enumerate(ids):
        clock.now = float(i)  # later ids are newer
        started = asyncio.Event()
        tasks.append(asyncio.create_task(hold(slots, id, 10, aborted, started)))
        await asyncio.wait_for(started.wait(), 1)
    return tasks


async def test_chat_preempts_batch_newest_first_and_batch_returns_after_the_cool_down():
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=1, cool_down_s=2.0, clock=clock)
    tasks = await start_batch(slots, ["a", "b", "c"], clock, aborted)
    async with slots.interactive_request():
        assert aborted == ["c", "b"] and slots.cap == 1  # busy_cap 1: the oldest keeps running
        await asyncio.gather(*tasks[1:])
    clock.now = 10.0
    assert slots.cap == 1  # calm only just began
    waiter = asyncio.create_task(start_batch(slots, ["d"], clock, aborted))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    clock.now = 12.5  # the cool-down has passed: the waiting one gets in on the next event
    await slots.direct(None)  # (the fleet controller's tick; on a real clock, the cool-down's end)
    more = await asyncio.wait_for(waiter, 2)
    assert slots.cap == 4 and set(slots.holds) == {"a", "d"}
    for t in [tasks[0], *more]:
        t.cancel()


async def test_the_fleet_cap_preempts_down_to_it_and_lifting_it_lets_batch_back():
    clock, aborted = Clock(), []
    slots = EngineSlots(8, clock=clock)
    tasks = await start_batch(slots, ["a", "b", "c"], clock, aborted)
    await slots.direct(1)
    assert aborted == ["c", "b"] and slots.cap == 1 and slots.snapshot()["fleet_cap"] == 1
    await asyncio.gather(*tasks[1:])
    waiter = asyncio.create_task(start_batch(slots, ["d"], clock, aborted))
    await asyncio.sleep(0.05)
    assert not waiter.done() and slots.snapshot()["batch_queued"] == 1
    await slots.direct(None)
    more = await asyncio.wait_for(waiter, 2)
    assert slots.cap == 8 and set(slots.holds) == {"a", "d"} and slots.snapshot()["batch_queued"] == 0
    for t in [tasks[0], *more]:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_reports_carry_the_interactive_peak_since_the_last_one():
    slots = EngineSlots(8, report_window=1)
    async with slots.interactive_request():
        async with slots.interactive_request():
            pass
        assert slots.report()["interactive"] == 2
        assert slots.report()["interactive"] == 1  # still one in flight
    assert slots.snapshot()["interactive"] == 0 and slots.report()["interactive"] == 1
    assert slots.report()["interactive"] == 0


async def test_reports_keep_a_peak_for_a_few_reports_so_a_slower_reader_sees_it():
    slots = EngineSlots(8)  # the peak of the last 3 reports
    async with slots.interactive_request():
        pass
    assert [slots.report()["interactive"] for _ in range(4)] == [1, 1, 1, 0]


async def test_continuous_chat_and_a_surge_cap_cannot_starve_batch_past_its_floor():
    clock, aborted = Clock(), []
    slots = EngineSlots(8, busy_cap=0, min_share=0.25, starve_after_s=30.0, clock=clock)  # floor: 2 slots
    assert not slots.by_floor
    tasks = await start_batch(slots, ["a", "b", "c"], clock, aborted)  # clock at 2.0
    await slots.direct(0)  # the pool surges: the fleet caps batch at 0
    async with slots.interactive_request():
        assert slots.cap == 0 and sorted(aborted) == ["a", "b", "c"]
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        clock.now = 20.0
        started = [asyncio.Event() for _ in range(3)]
        waiters = [asyncio.create_task(hold(slots, id, 10, [], ev)) for id, ev in zip("def", started, strict=True)]
        await asyncio.sleep(0.3)
        assert not slots.holds  # within the grace: chat has every slot
        clock.now = 33.0  # squeezed since t=2 for over 30 s: batch gets its floor back
        await slots.direct(0)  # the fleet's next tick
        await asyncio.sleep(0.6)
        assert slots.cap == 2 and len(slots.holds) == 2  # the floor, no more
        assert slots.by_floor  # which a training step then keeps to (policy.preemption.floor_pause)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_static_partition_caps_batch_at_its_share_and_chat_then_preempts_nothing():
    clock, aborted = Clock(), []
    slots = EngineSlots(8, busy_cap=8, max_share=0.5, clock=clock)  # batch: at most 4 slots, busy or not
    tasks = await start_batch(slots, ["a", "b", "c", "d"], clock, aborted)
    waiter = asyncio.create_task(start_batch(slots, ["e"], clock, aborted))
    await asyncio.sleep(0.3)
    assert not waiter.done() and slots.cap == 4  # the fifth waits though 4 slots are free
    async with slots.interactive_request(), slots.interactive_request():
        assert aborted == [] and slots.cap == 4  # chat fits in the other half
    waiter.cancel()
    for t in [*tasks, waiter]:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_without_preemption_batch_keeps_its_slots_through_chat_and_a_surge():
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=0, preemption=False, clock=clock)
    tasks = await start_batch(slots, ["a", "b", "c", "d"], clock, aborted)
    await slots.direct(0)
    async with slots.interactive_request():
        more = await asyncio.wait_for(start_batch(slots, ["e"], clock, aborted), 2)  # and takes a slot freed
        assert aborted == [] and len(slots.holds) == 5
    for t in [*tasks, *more]:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_the_report_counts_interactive_work_now_by_the_api_that_sent_it():
    """The peak is the fleet controller's; placement reads what is in flight now, by API
    process, so each API adds its own current streams to the others' reported ones."""
    slots = EngineSlots(8)
    async with slots.interactive_request("api-a"), slots.interactive_request("api-a"), \
            slots.interactive_request("api-b"):
        during = slots.report()
    after = slots.report()
    assert during["interactive_by"] == {"api-a": 2, "api-b": 1} and during["interactive"] == 3
    assert after["interactive_by"] == {} and after["interactive"] == 3  # the peak lingers; the count does not


async def test_a_request_of_several_choices_counts_as_that_many_sequences():
    """`n` choices are n of vLLM's sequences: batch yields that many slots, and placement
    reads that load."""
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=4, clock=clock)  # batch may keep whatever chat leaves free
    tasks = await start_batch(slots, ["a", "b", "c", "d"], clock, aborted)
    async with slots.interactive_request("api-a", seqs=3):
        assert slots.cap == 1 and aborted == ["d", "c", "b"]  # newest first, one left for batch
        assert slots.report()["interactive_by"] == {"api-a": 3}
        await asyncio.gather(*tasks[1:])
    assert slots.report()["interactive_by"] == {}
    tasks[0].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[0]


async def test_batch_comes_back_at_once_after_chat_on_an_engine_whose_calm_spells_are_long():
    """Priced resumption (policy.preemption.resume_after): eight calm spells of 5 s seen, a
    resumption measured at 0.2 s: batch takes its slots back as soon as chat ends, with
    no cool-down; with the fixed policy it waits the cool-down as before."""
    for priced, wait in ((True, 0.0), (False, 2.0)):
        clock = Clock()
        slots = EngineSlots(4, cool_down_s=2.0, clock=clock, priced=priced)
        slots.resume_costs.append(0.2)
        for _ in range(9):  # the first spell begins at the first chat's end
            async with slots.interactive_request():
                clock.now += 0.5
            clock.now += 5.0
        async with slots.interactive_request():
            assert slots.cap == 0
            clock.now += 0.5
        assert (slots.wait_s, slots.cap) == (wait, 4 if priced else 0), slots.spells


class Turns:
    """Batch holds on an engine of one slot, in the order they got it; each held until let go."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = EngineSlots(slots)
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def run(self, id: str, deadline: float | None) -> None:
        async def abort():
            pass

        self.release[id] = asyncio.Event()
        async with self.slots.batch(id, 10, abort, deadline, owner=id.split(":")[0]):
            self.order.append(id)
            await self.release[id].wait()

    async def asked(self, *waiters: tuple[str, float | None]) -> dict[str, asyncio.Task]:
        """Each starts waiting, in this order (an id's tenant is what precedes its colon)."""
        tasks = {}
        for id, deadline in waiters:
            tasks[id] = asyncio.create_task(self.run(id, deadline))
            await asyncio.sleep(0)
        return tasks

    async def served(self, *ids: str) -> None:
        """They get the slot in this order, each let go in turn."""
        for id in ids:
            for _ in range(5):
                await asyncio.sleep(0)
            assert self.order[-1] == id
            self.release[id].set()


async def test_waiting_generations_take_slots_earliest_deadline_first_and_a_cancelled_one_passes_its_turn():
    now = time.time()
    t = Turns()
    first = await t.asked(("holder", now))
    tasks = await t.asked(("tomorrow", now + 11 * 3600), ("in-an-hour", now + 3600), ("gone", now + 60),
                          ("also-in-an-hour", now + 3600))
    assert t.slots.queued == 4
    tasks["gone"].cancel()  # the earliest deadline, cancelled while it waits: the next goes
    with contextlib.suppress(asyncio.CancelledError):
        await tasks["gone"]
    await t.served("holder", "in-an-hour", "also-in-an-hour", "tomorrow")
    await asyncio.gather(*first.values(), *(task for k, task in tasks.items() if k != "gone"))
    assert t.order == ["holder", "in-an-hour", "also-in-an-hour", "tomorrow"] and t.slots.queued == 0
    assert not t.slots._urgent and not t.slots._by_owner and not t.slots._gave_up


async def test_work_without_a_window_takes_its_turn_behind_work_due_soon_not_behind_a_later_day_s_batch():
    now = time.time()
    t = Turns()
    # A fine-tuning chunk asks now; a day's batch created after it, and one due in an hour.
    tasks = await t.asked(("holder", now), ("chunk", None), ("day-later", now + 86_400 + 60), ("hour", now + 3600))
    await t.served("holder", "hour", "chunk", "day-later")
    await asyncio.gather(*tasks.values())
    assert t.order == ["holder", "hour", "chunk", "day-later"]


async def test_work_not_due_within_half_a_day_waits_by_arrival_so_an_old_backlog_starves_nothing():
    now = time.time()
    t = Turns()
    # A chunk asks first; then an item of a backlog made 10 h ago (due in 14 h), and one of a
    # batch made 13 h ago (due in 11 h: urgent now).
    tasks = await t.asked(("holder", now), ("chunk", None), ("old-backlog", now + 14 * 3600),
                          ("due-soon", now + 11 * 3600))
    await t.served("holder", "due-soon", "chunk", "old-backlog")
    await asyncio.gather(*tasks.values())
    assert t.order == ["holder", "due-soon", "chunk", "old-backlog"]


async def test_work_not_due_soon_takes_turns_by_tenant_so_a_backlog_starves_no_job():
    """A tenant's day-long backlog has hundreds of items asking at once; a fine-tuning chunk
    of another tenant asking after them still gets the next slot, and the slots then
    alternate between the two while both wait."""
    now = time.time()
    t = Turns(slots=1)
    day = now + 86_400
    tasks = await t.asked(("bulk:0", day), ("bulk:1", day), ("bulk:2", day), ("bulk:3", day),
                          ("trainer:chunk-1", None), ("trainer:chunk-2", None))
    await t.served("bulk:0", "trainer:chunk-1", "bulk:1", "trainer:chunk-2", "bulk:2", "bulk:3")
    await asyncio.gather(*tasks.values())
    assert not t.slots._by_owner


async def test_reserved_slots_left_unused_are_lent_to_batch_through_chat_and_asked_for_at_once():
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=0, cool_down_s=2.0, clock=clock)
    await slots.lend(2)  # two reserved slots nobody uses: no other chat may take them
    tasks = await start_batch(slots, ["a", "b", "c"], clock, aborted)
    async with slots.interactive_request():  # another tenant's chat: batch keeps the lent two
        assert slots.cap == 2 and aborted == ["c"]
        await slots.lend(1)  # the reserved tenant's request takes one: batch yields it at once
        assert slots.cap == 1 and aborted == ["c", "b"]
        await asyncio.gather(*tasks[1:])
    await slots.lend(0)
    tasks[0].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[0]


async def test_with_spare_sequences_a_slot_taken_back_is_not_aborted_and_lent_slots_outlast_a_surge():
    """vLLM runs two sequences beyond the slots: the reserved tenant's request starts beside
    the batch generation on its slot, which runs on (parked) while batch is granted nothing
    new; and through a surge the unused reserved slots stay lent."""
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=0, cool_down_s=2.0, clock=clock, spare=2)
    await slots.lend(2)
    tasks = await start_batch(slots, ["a", "b", "c"], clock, aborted)
    await slots.direct(0)  # the pool surges: the shared slots go, the lent two stay
    assert slots.cap == 2 and aborted == ["c"]
    await tasks[2]
    async with slots.interactive_request():
        await slots.lend(1, taken=1)  # the reserved tenant's request takes one
        assert slots.cap == 1 and slots.parked == 1 and aborted == ["c"]  # nothing more aborted
        granted = asyncio.Event()  # its own hold, not start_batch's: cancelled, nothing is left waiting
        waiter = asyncio.create_task(hold(slots, "d", 10, aborted, granted))
        await asyncio.sleep(0.05)
        assert not waiter.done() and not granted.is_set()  # over the cap: no new slot while one is parked
        await slots.lend(0, taken=2)  # both taken: both generations run on
        assert slots.cap == 0 and aborted == ["c"]
        await slots.lend(2, taken=0)  # the tenant's requests end: the slots are lent again
        assert slots.cap == 2 and slots.parked == 0 and aborted == ["c"]
    waiter.cancel()
    for t in tasks[:2]:
        t.cancel()
    await asyncio.gather(waiter, *tasks[:2], return_exceptions=True)


async def test_without_spare_sequences_a_surge_lends_nothing_and_a_taken_slot_is_aborted():
    clock, aborted = Clock(), []
    slots = EngineSlots(4, busy_cap=0, cool_down_s=2.0, clock=clock)
    await slots.lend(2)
    tasks = await start_batch(slots, ["a", "b"], clock, aborted)
    await slots.direct(0)
    assert slots.cap == 0 and aborted == ["b", "a"]
    await asyncio.gather(*tasks)


async def test_busy_seconds_count_only_while_batch_work_holds_a_slot():
    """The time a batch pace is measured over (policy/promises.py): overlapping holds count
    once, idle gaps not at all."""
    clock = Clock()
    slots = EngineSlots(4, clock=clock)

    async def nothing():
        pass

    clock.now = 10.0
    async with slots.batch("a", 10, nothing):
        clock.now = 11.0
        async with slots.batch("b", 10, nothing):
            clock.now = 12.0
        clock.now = 13.0
        assert slots.busy_s() == 3.0  # counted while held, too
    clock.now = 50.0  # idle
    async with slots.batch("c", 10, nothing):
        clock.now = 50.5
    clock.now = 99.0
    assert slots.busy_s() == 3.5


async def test_a_waiter_cancelled_as_its_timeout_fires_leaves_the_slots_usable():
    """A waiter's timeout fires while another task holds the engine's lock, and the waiter
    is cancelled before it has the lock back: it must leave with the lock released, or every
    later batch hold, chat and announce of the engine blocks for ever."""
    slots = EngineSlots(1)
    slots._next_change = lambda: 0.005
    release = asyncio.Event()

    async def nothing():
        pass

    async def holder():
        async with slots.batch("holder", 10, nothing):
            await release.wait()

    held = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(slots.batch("waiter", 10, nothing).__aenter__())
    await asyncio.sleep(0.001)  # waiting, the lock let go
    await slots._changed.acquire()  # a chat or an announce takes it...
    await asyncio.sleep(0.02)  # ...while the waiter's timeout fires: it waits to get the lock back
    waiter.cancel()  # cancelled, and in the same turn of the loop the lock let go
    slots._changed.release()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 1)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not slots._changed.locked(), "the cancelled waiter left the lock held"
    release.set()
    await asyncio.wait_for(held, 1)
    async with asyncio.timeout(1):
        async with slots.batch("after", 10, nothing):
            pass
