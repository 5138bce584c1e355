"""Interactive requests journaled by the window: one workflow per window per API process.

A request that has ended, its outcome known, is handed to this process's window (`add`,
no I/O). Every `window_s`, or as soon as `max_requests` have gathered, the window starts
ONE workflow (workflows/interactive.py) carrying them all, whose local activity settles
each in the ledger and journals their outcomes (one `request_finished` event per tenant)
in one transaction: 2 billed Temporal actions for the window, not 2 per request, and
nothing on any request's path.

The guarantee stays the per-request one: every request an engine served is journaled and
settled exactly once. A window whose workflow cannot start (Temporal unreachable), or one
this process dies holding, is journaled by the quota reconciler from the engines' own
records (journal/served.py) after `unreported_after_s`; the reservations of a window that
could not start are closed at once (`Ticket.unjournaled`), so they do not hold quota
meanwhile. At shutdown the open window is started before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry.trace import SpanContext
from temporalio.exceptions import WorkflowAlreadyStartedError

from api.services.admission import Ticket
from protocol import keys
from protocol.temporal import InteractiveInput, RequestWindowInput
from telemetry import tracing

log = logging.getLogger(__name__)

# Starts the window's workflow under this id.
Start = Callable[[str, RequestWindowInput], Awaitable[object]]


@dataclass
class Ended:
    request: InteractiveInput  # with its outcome
    ticket: Ticket | None  # its reservation, where it was admitted through one
    trace: SpanContext | None  # the request's span, which the window's span links to


class Settlement:
    def __init__(self, start: Start, holder: str, *, window_s: float, max_requests: int):
        self._start, self.holder = start, holder
        self.window_s, self.max_requests = window_s, max_requests
        self._open: list[Ended] = []
        self._wake = asyncio.Event()  # a window is full, or the process is stopping
        self._stopping = False
        self._windows = 0
        self._task: asyncio.Task | None = None

    def add(self, request: InteractiveInput, ticket: Ticket | None = None) -> None:
        """`request` (carrying its outcome) into the open window; called where the request
        ended, so its trace is the current one."""
        assert request.outcome is not None
        self._open.append(Ended(request, ticket, tracing.current()))
        if len(self._open) >= self.max_requests:
            self._wake.set()

    def start(self) -> Settlement:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        """Stop the timer and start what is still open. The timer is woken, not cancelled:
        cancelled mid-start, the window it had taken would be lost to this process, its
        reservations left open until their holder expires."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            await self._task
        await self.flush()

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.window_s)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # never let one window end the timer
                log.exception("could not settle a window of requests")

    async def flush(self) -> None:
        """Start a workflow for each `max_requests` of what is open now (what ends while
        they start waits for the next window)."""
        pending, self._open = self._open, []
        for at in range(0, len(pending), self.max_requests):
            window = pending[at:at + self.max_requests]
            self._windows += 1
            workflow_id = keys.request_window(self.holder, self._windows)
            with tracing.linked("settle requests", [e.trace for e in window],
                                {"ballast.requests": len(window), "ballast.window": workflow_id}):
                try:
                    await self._start(workflow_id, RequestWindowInput(self.holder, [e.request for e in window]))
                except WorkflowAlreadyStartedError:
                    pass  # an earlier try started it after all (its answer was lost)
                except Exception:
                    log.exception("could not start the workflow of %d requests (%s); their engines' records will "
                                  "account for them", len(window), workflow_id)
                    for e in window:
                        if e.ticket is not None:
                            e.ticket.unjournaled()
