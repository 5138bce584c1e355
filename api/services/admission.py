"""Admission on the request path: decide from memory, write the ledger off the path.

`Admission` is per API process (its `holder` id). It decides with `policy.admission.admit`
over a local view of each tenant's usage:
- its own admissions, exact: counted the moment they are admitted, corrected when the
  engine reports the prompt's real size, released the moment the request ends;
- every other process's, as the reconciler last folded them into `quota_usage` (rows per
  holder, so none of its own are counted twice), and `limits`: both re-read every
  `admission_refresh_s` by a background task, which also marks the holder as seen.
A decision reads memory only (no await in local mode). Reserve rows reach the ledger by
a background flusher, one multi-row INSERT per `admission_flush_s` tick. A prompt the
API tokenized is reserved at its exact size; an estimated one (no tokenizer in this
process yet) waits at most one tick for the engine's corrected figures, so the row
usually carries them. Settles are not written here: the transaction that journals the request's outcome
writes them (`activities/interactive.py`). Hence the overshoot bound in policy/admission.py.

While Postgres is unreachable the view ages and decisions go on from it (own admissions
stay exact, so one process alone never passes a limit); reserve rows wait in memory.

`admission_mode = "sync"` is the baseline the bench compares with: one transaction per
decision (the tenant's advisory lock, its limits and exact usage from the ledger, the
reserve row), so no overshoot, at a database round trip per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from config import Settings
from journal import ledger
from journal.ledger import REFUND, RESERVE, Counts, Entry
from policy.admission import (
    ANY_MODEL,
    DAY_S,
    MINUTE_S,
    Demand,
    Headroom,
    LimitSet,
    Refuse,
    Usage,
    admit,
    reserve_output,
    staleness_s,
    window_start,
)
from protocol import keys

log = logging.getLogger(__name__)


def default_holder() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Decided:
    """What admission decided about the request under way, for its `x-ratelimit-*` headers
    (api/ratelimit_headers.py, which sets a fresh one per request in DECIDED)."""

    tenant: str = ""
    model: str = ""  # the pool it was counted against
    # Sync mode only: each limit that applied with the usage the deciding transaction read,
    # this request included where it was admitted (the in-memory view lacks this process's own).
    seen: tuple[tuple[LimitSet, Usage], ...] | None = None


DECIDED: ContextVar[Decided | None] = ContextVar("ballast_admission_decided", default=None)


class Ticket:
    """One admitted request's reservation, from admission until the request ends."""

    __slots__ = ("_adm", "subject", "tenant", "model", "tier", "input_tokens", "output_tokens", "max_tokens", "at",
                 "minute", "day", "counted", "corrected", "ended", "waited", "flushed", "refund", "choices")

    def __init__(self, adm: Admission, subject: str, tenant: str, model: str, tier: str, input_tokens: int,
                 output_tokens: int, max_tokens: int | None, at: float):
        self._adm = adm
        self.subject, self.tenant, self.model, self.tier = subject, tenant, model, tier
        self.input_tokens, self.output_tokens, self.max_tokens, self.at = input_tokens, output_tokens, max_tokens, at
        self.minute, self.day = window_start(at, MINUTE_S), window_start(at, DAY_S)
        self.counted = self.corrected = self.ended = self.waited = self.flushed = self.refund = False
        self.choices = 1  # `n`: max_tokens is reserved for each

    @property
    def holder(self) -> str:
        return self._adm.holder

    def entry(self) -> Entry:
        """The reserve row, as it stands now."""
        return Entry(RESERVE, self.subject, self.tenant, self.model, self.tier, self.input_tokens,
                     self.output_tokens, self._adm.holder, ledger.timestamp(self.at))

    def correct(self, prompt_tokens: int) -> None:
        """The engine has tokenized the prompt: reserve what it really holds."""
        if self.ended or self.corrected:
            return
        out = reserve_output(prompt_tokens, self.max_tokens, self._adm.max_model_len, self.choices)
        self._adm._adjust(self, prompt_tokens - self.input_tokens, out - self.output_tokens)
        self.input_tokens, self.output_tokens, self.corrected = prompt_tokens, out, True

    def release(self, input_tokens: int, output_tokens: int) -> None:
        """The request ended after an engine took it: count what it used from now on (the
        journaling transaction settles it in the ledger)."""
        if self.ended:
            return
        self.ended = True
        self._adm._adjust(self, input_tokens - self.input_tokens, output_tokens - self.output_tokens, -1)

    def cancel(self) -> None:
        """The request ended before any engine took it: no usage, the reservation is
        refunded whole (by the flusher)."""
        if self.ended:
            return
        self.ended = True
        self._adm._adjust(self, -self.input_tokens, -self.output_tokens, -1)
        self._adm._refund(self)

    def unjournaled(self) -> None:
        """The request ran but its workflow could not start: close the reservation with a
        refund now rather than leave it open until the quota reconciler settles the request
        from the engine's record (journal/served.py; the settle still counts then). This
        process's own count keeps what it used."""
        self.release(self.input_tokens, self.output_tokens)
        if not self.refund:
            self._adm._refund(self)


class Admission:
    def __init__(self, db: AsyncEngine, settings: Settings, *, holder: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.db = db
        self.mode: Literal["local", "sync"] = settings.admission_mode
        self.max_model_len = settings.max_model_len
        self.headroom = Headroom(settings.admission_headroom_priority, settings.admission_headroom_default,
                                 settings.admission_headroom_flex)
        self.refresh_s, self.flush_s = settings.admission_refresh_s, settings.admission_flush_s
        self.staleness_s = staleness_s(self.flush_s, self.refresh_s)
        self.holder = holder or default_holder()
        self.clock = clock
        self._limits: dict[str, tuple[LimitSet, ...]] = {}
        self._own: dict[str, dict[str, Counts]] = {}  # tenant → model → this process's usage
        self._others: dict[str, dict[str, Counts]] = {}  # the other holders', as last folded
        self._unflushed: list[Ticket] = []
        self._refunds: list[str] = []  # subjects whose reservation is written, to refund whole
        self._tasks: list[asyncio.Task] = []
        self.refreshed_at: float | None = None  # this process's clock

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Admission:
        """Register the holder (before any of its reservations can reach the ledger), read
        the limits and usage once, then keep refreshing and flushing in the background."""
        await self.refresh()
        self._tasks = [asyncio.create_task(self._every(self.refresh_s, self.refresh), name="admission-refresh"),
                       asyncio.create_task(self._every(self.flush_s, self.flush), name="admission-flush")]
        return self

    async def stop(self, *, flush: bool = True) -> None:
        """Stop the background work; write what is still unwritten unless `flush` is False
        (a process that dies: its reservations stay open until the reconciler expires them)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if flush:
            for ticket in self._unflushed:
                ticket.waited = True
            await self.flush()

    async def _every(self, period_s: float, step: Callable) -> None:
        """`step` at a fixed rate (its own duration does not stretch the period: the
        staleness bound counts on it); a step that overruns is not made up for."""
        due = time.monotonic()
        while True:
            due += period_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                await step()
            except Exception as err:  # Postgres is back soon; the view ages meanwhile
                log.warning("admission %s failed: %s", getattr(step, "__name__", step), err)
            due = max(due, time.monotonic() - period_s)

    # -- deciding -------------------------------------------------------------------------

    async def reserve(self, request_id: str, tenant: str, model: str, tier: str, input_tokens: int,
                      max_tokens: int | None, *, fleet_busy: bool = False, counted: bool = False,
                      choices: int = 1) -> Ticket | Refuse:
        """Admit a request (a Ticket to carry to its end) or say which limit refuses it.
        `counted`: `input_tokens` is the prompt's exact size (the API tokenized it as the
        engine will), so its reserve row need not wait for the engine's figure. `choices`:
        its `n`, each of which may take `max_tokens` (0: it generates nothing, as embeddings)."""
        output_tokens = reserve_output(input_tokens, max_tokens, self.max_model_len, choices)
        if (note := DECIDED.get()) is not None:
            note.tenant, note.model = tenant, model
        if self.mode == "sync":
            got = await self._reserve_sync(request_id, tenant, model, tier, input_tokens, output_tokens, max_tokens,
                                           fleet_busy)
        else:
            got = self.reserve_local(request_id, tenant, model, tier, input_tokens, output_tokens, max_tokens,
                                     fleet_busy)
            if isinstance(got, Ticket):
                got.counted = counted  # ready to write; the engine's figure still corrects it if it differs
        if isinstance(got, Ticket):
            got.choices = choices
        return got

    def reserve_local(self, request_id: str, tenant: str, model: str, tier: str, input_tokens: int,
                      output_tokens: int, max_tokens: int | None, fleet_busy: bool = False) -> Ticket | Refuse:
        """The local decision: memory only."""
        now = self.clock()
        sets = self._limits.get(tenant)
        if sets or fleet_busy:
            minute, day = window_start(now, MINUTE_S), window_start(now, DAY_S)
            scopes = [(s, self.usage(tenant, s.model, model, minute, day)) for s in sets or ()
                      if s.model == ANY_MODEL or s.model == model]
            decision = admit(Demand(tier, input_tokens, output_tokens), scopes, now,
                             self.headroom, fleet_busy)
            if isinstance(decision, Refuse):
                return decision
        ticket = Ticket(self, keys.request(request_id), tenant, model, tier, input_tokens, output_tokens,
                        max_tokens, now)
        c = self._counts(tenant, model, ticket.minute, ticket.day)
        c.requests += 1
        c.input_tokens += input_tokens
        c.output_tokens += output_tokens
        c.day_tokens += input_tokens + output_tokens
        c.in_flight += 1
        self._unflushed.append(ticket)
        return ticket

    def usage(self, tenant: str, scope: str, model: str, minute: float, day: float) -> Usage:
        """What counts against a limit of `scope` ('*' or `model`): own exact + others folded."""
        requests = input_tokens = output_tokens = day_tokens = in_flight = batch = 0
        for view in (self._own, self._others):
            by_model = view.get(tenant)
            if not by_model:
                continue
            if scope == ANY_MODEL:
                counts = list(by_model.values())
            else:
                one = by_model.get(model)
                counts = [one] if one is not None else []
            for c in counts:
                if c.minute == minute:
                    requests += c.requests
                    input_tokens += c.input_tokens
                    output_tokens += c.output_tokens
                if c.day == day:
                    day_tokens += c.day_tokens
                in_flight += c.in_flight
                batch += c.batch_queue_tokens
        return Usage(requests, input_tokens, output_tokens, day_tokens, in_flight, batch)

    def standing(self, tenant: str, model: str | None = None) -> list[tuple[LimitSet, Usage]]:
        """Each of the tenant's limits (those that apply to `model`; None: all) with what
        this process sees counting against it now. Memory only."""
        now = self.clock()
        minute, day = window_start(now, MINUTE_S), window_start(now, DAY_S)
        return [(s, self.usage(tenant, s.model, model or s.model, minute, day)) for s in self.limits(tenant)
                if model is None or s.model in (ANY_MODEL, model)]

    def limits(self, tenant: str) -> tuple[LimitSet, ...]:
        """The tenant's limits, as last read."""
        return self._limits.get(tenant, ())

    def _counts(self, tenant: str, model: str, minute: float, day: float) -> Counts:
        c = self._own.setdefault(tenant, {}).get(model)
        if c is None:
            c = self._own[tenant][model] = Counts(minute, day)
        if c.minute != minute:  # a new window: what counted in the last one no longer does
            c.minute, c.requests, c.input_tokens, c.output_tokens = minute, 0, 0, 0
        if c.day != day:
            c.day, c.day_tokens = day, 0
        return c

    def _adjust(self, t: Ticket, d_in: int, d_out: int, d_flight: int = 0) -> None:
        if self.mode == "sync":
            return  # decisions read the ledger
        c = self._own[t.tenant][t.model]
        if c.minute == t.minute:  # changes to a window that has ended no longer matter
            c.input_tokens += d_in
            c.output_tokens += d_out
        if c.day == t.day:
            c.day_tokens += d_in + d_out
        c.in_flight += d_flight

    def _refund(self, t: Ticket) -> None:
        if t.flushed:
            self._refunds.append(t.subject)  # refunds what the ledger's reservation holds
        else:
            t.refund = True  # written with its reserve row

    async def _reserve_sync(self, request_id: str, tenant: str, model: str, tier: str, input_tokens: int,
                            output_tokens: int, max_tokens: int | None, fleet_busy: bool) -> Ticket | Refuse:
        """The baseline: one transaction per decision, exact, serialised per tenant."""
        now = self.clock()
        minute, day = window_start(now, MINUTE_S), window_start(now, DAY_S)
        async with self.db.begin() as conn:
            await ledger.lock_tenant(conn, tenant)
            sets = (await ledger.load_limits(conn, tenant)).get(tenant, ())
            if sets or fleet_busy:
                daily = any(s.tokens_per_day is not None for s in sets)
                by_model = await ledger.usage(conn, tenant, minute, day, now, day_tokens=daily,
                                              in_flight=any(s.concurrent_requests is not None for s in sets))
                if daily:  # the tenant's fine-tuning spends the same daily tokens
                    for m, n in (await ledger.trained_tokens(conn, tenant, day)).items():
                        by_model.setdefault(m, Counts(minute, day)).day_tokens += n
                scopes = []
                for s in sets:
                    if s.model == ANY_MODEL or s.model == model:
                        counts = list(by_model.values()) if s.model == ANY_MODEL else [by_model.get(model, Counts())]
                        scopes.append((s, Usage(sum(c.requests for c in counts), sum(c.input_tokens for c in counts),
                                                sum(c.output_tokens for c in counts),
                                                sum(c.day_tokens for c in counts),
                                                sum(c.in_flight for c in counts))))
                decision = admit(Demand(tier, input_tokens, output_tokens), scopes, now,
                                 self.headroom, fleet_busy)
                if (note := DECIDED.get()) is not None:
                    note.seen = tuple(scopes) if isinstance(decision, Refuse) else tuple(
                        (s, _plus(u, input_tokens, output_tokens)) for s, u in scopes)
                if isinstance(decision, Refuse):
                    return decision
            ticket = Ticket(self, keys.request(request_id), tenant, model, tier, input_tokens,
                            output_tokens, max_tokens, now)
            await ledger.insert(conn, [ticket.entry()])
        ticket.flushed = True
        return ticket

    # -- background: flush, refresh -------------------------------------------------------------

    async def flush(self) -> int:
        """Write the reservations ready to go (counted, corrected, ended, or held back one tick
        already) in one INSERT, and pending refunds, in one transaction. Rows written."""
        ready, keep = [], []
        for t in self._unflushed:
            if t.counted or t.corrected or t.ended or t.waited:
                ready.append(t)
            else:
                t.waited = True
                keep.append(t)
        refunds, self._refunds = self._refunds, []
        if not ready and not refunds:
            return 0
        self._unflushed = keep
        entries: list[Entry] = []
        for t in ready:
            t.flushed = True  # a cancel from now on queues its refund separately
            entries.append(t.entry())
            if t.refund:
                entries.append(t.entry().closing(REFUND))
        try:
            async with self.db.begin() as conn:
                written = len(await ledger.insert(conn, entries))
                for subject in refunds:
                    written += await ledger.refund(conn, subject)
        except BaseException:
            for t in ready:
                t.flushed = False
            self._unflushed = ready + self._unflushed
            self._refunds = refunds + self._refunds
            raise
        return written

    async def refresh(self) -> None:
        """Mark this holder seen; read every tenant's limits and the others' usage."""
        async with self.db.begin() as conn:
            await ledger.seen(conn, self.holder)
            limits = await ledger.load_limits(conn)
            rows = await ledger.others(conn, self.holder)
            now = self.clock()
            minute, day = window_start(now, MINUTE_S), window_start(now, DAY_S)
            # Fine-tuning's tokens, which engine workers settle with no reservation: another
            # holder's spending of the same daily tokens.
            trained = await ledger.trained_by_tenant(conn, day) if any(
                s.tokens_per_day is not None for sets in limits.values() for s in sets) else {}
        latest_day = max((r["starts_at"].timestamp() for r in rows if r["window"] == "day"), default=None)
        others: dict[str, dict[str, Counts]] = {}
        for r in rows:
            c = others.setdefault(r["tenant"], {}).setdefault(r["model"], Counts(minute, day))
            starts = r["starts_at"].timestamp()
            if r["window"] == "minute" and starts == minute:
                c.requests += r["requests"]
                c.input_tokens += r["input_tokens"]
                c.output_tokens += r["output_tokens"]
            elif r["window"] == "day":
                if starts == day:
                    c.day_tokens += r["input_tokens"] + r["output_tokens"]
                if starts == latest_day:
                    c.in_flight += r["in_flight"]
                    c.batch_queue_tokens += r["batch_queue_tokens"]
        for tenant, by_model in trained.items():
            for model, n in by_model.items():
                others.setdefault(tenant, {}).setdefault(model, Counts(minute, day)).day_tokens += n
        self._limits, self._others, self.refreshed_at = limits, others, now


def _plus(u: Usage, input_tokens: int, output_tokens: int) -> Usage:
    """`u` with one more request of these tokens."""
    return Usage(u.requests + 1, u.input_tokens + input_tokens, u.output_tokens + output_tokens,
                 u.day_tokens + input_tokens + output_tokens, u.in_flight + 1, u.batch_queue_tokens)
