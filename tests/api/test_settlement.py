"""The window (api/services/settlement.py): the requests that end within `window_s` go to
Temporal in one start; a full window goes at once; a start that fails closes the window's
reservations; shutdown starts what is still open. The oracle is the fake start's own
record of what it was called with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.exceptions import WorkflowAlreadyStartedError

from api.services.settlement import Settlement
from protocol.temporal import InteractiveInput, RequestOutcome, RequestWindowInput


def ended(n: int) -> InteractiveInput:
    return InteractiveInput(f"r{n}", "t", "default", "m", "/v1/chat/completions", "engine-1", 5,
                            outcome=RequestOutcome("completed", 3))


class Ticket:
    def __init__(self):
        self.unjournaled_calls = 0

    def unjournaled(self) -> None:
        self.unjournaled_calls += 1


class Starts:
    def __init__(self, fail: BaseException | None = None, takes_s: float = 0.0):
        self.calls: list[tuple[str, RequestWindowInput]] = []
        self.fail, self.takes_s = fail, takes_s
        self.done = 0  # starts that ran to their end

    async def __call__(self, workflow_id: str, window: RequestWindowInput) -> None:
        self.calls.append((workflow_id, window))
        await asyncio.sleep(self.takes_s)
        self.done += 1
        if self.fail is not None:
            raise self.fail

    def ids(self) -> list[list[str]]:
        return [[r.request_id for r in w.requests] for _, w in self.calls]


@contextlib.asynccontextmanager
async def running(starts: Starts, window_s: float, max_requests: int = 100) -> AsyncIterator[Settlement]:
    s = Settlement(starts, "api-1", window_s=window_s, max_requests=max_requests).start()
    try:
        yield s
    finally:
        await s.stop()


async def started(starts: Starts, n: int) -> None:
    for _ in range(500):
        if len(starts.calls) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(starts.calls)} starts, not {n}")


async def test_the_requests_of_a_window_go_in_one_start():
    starts = Starts()
    async with running(starts, window_s=0.5) as s:
        for i in range(7):
            s.add(ended(i))
            await asyncio.sleep(0)
        assert starts.calls == []  # nothing on the request's path
        await started(starts, 1)
        assert starts.ids() == [[f"r{i}" for i in range(7)]]
        s.add(ended(7))
        await started(starts, 2)
        assert starts.ids()[1:] == [["r7"]]
        assert [wid for wid, _ in starts.calls] == ["requests:api-1:1", "requests:api-1:2"]  # unique, in order
        assert {w.holder for _, w in starts.calls} == {"api-1"}


async def test_a_full_window_goes_at_once_and_a_burst_is_cut_into_windows():
    starts = Starts()
    async with running(starts, window_s=30, max_requests=3) as s:
        for i in range(3):
            s.add(ended(i))
        await started(starts, 1)  # long before the window's time
        assert starts.ids() == [["r0", "r1", "r2"]]
    flushing = Settlement(starts, "api-1", window_s=30, max_requests=3)
    for i in range(3, 10):
        flushing.add(ended(i))
    await flushing.flush()
    assert starts.ids()[1:] == [["r3", "r4", "r5"], ["r6", "r7", "r8"], ["r9"]]


async def test_what_ends_while_a_window_starts_waits_for_the_next_window():
    """A start is an RPC: requests that end meanwhile must not each go in a window of
    their own right after it."""
    starts = Starts(takes_s=0.2)
    s = Settlement(starts, "api-1", window_s=30, max_requests=100)
    for i in range(3):
        s.add(ended(i))
    flushing = asyncio.create_task(s.flush())
    await started(starts, 1)
    s.add(ended(3))
    s.add(ended(4))
    await flushing
    assert starts.ids() == [["r0", "r1", "r2"]]
    await s.flush()
    assert starts.ids()[1:] == [["r3", "r4"]]


async def test_shutdown_starts_what_is_still_open():
    starts = Starts()
    s = Settlement(starts, "api-1", window_s=30, max_requests=100).start()
    s.add(ended(1))
    s.add(ended(2))
    await s.stop()
    assert starts.ids() == [["r1", "r2"]]


async def test_stopping_while_a_window_starts_lets_that_start_finish():
    starts = Starts(takes_s=0.3)
    s = Settlement(starts, "api-1", window_s=0.05, max_requests=100).start()
    s.add(ended(0))
    await started(starts, 1)  # its start in flight
    s.add(ended(1))
    await s.stop()
    assert starts.ids() == [["r0"], ["r1"]] and starts.done == 2


@pytest.mark.parametrize("error, closed", [(RuntimeError("Temporal is unreachable"), 1),
                                           (WorkflowAlreadyStartedError("requests:api-1:1", "RequestWindow"), 0)])
async def test_a_window_that_could_not_start_closes_its_reservations(error, closed):
    """Where the start failed, the engines' records will account for the requests: their
    reservations are closed now. Where an earlier try had started it after all, nothing is."""
    starts = Starts(fail=error)
    s = Settlement(starts, "api-1", window_s=30, max_requests=100)
    tickets: list[Any] = [Ticket(), None, Ticket()]
    for i, t in enumerate(tickets):
        s.add(ended(i), t)
    await s.flush()
    assert [t.unjournaled_calls for t in tickets if t is not None] == [closed, closed]
    s.add(ended(9))
    await s.flush()  # the next window is tried as ever
    assert starts.ids()[-1] == ["r9"]


async def test_a_failing_start_does_not_stop_the_timer():
    starts = Starts(fail=RuntimeError("down"))
    async with running(starts, window_s=0.05) as s:
        s.add(ended(1))
        await started(starts, 1)
        starts.fail = None
        s.add(ended(2))
        await started(starts, 2)
        assert starts.ids() == [["r1"], ["r2"]]
