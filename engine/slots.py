"""Who may hold the engine: the per-engine side of preemption.

Interactive requests are counted and never wait here. Batch generations hold a slot while
they run on vLLM; when interactive demand rises the cap from `policy.preemption` drops
and the victims it names are aborted in vLLM at once (their slot and KV blocks are free at
the engine's next step). Each victim's generation then flushes its tokens to the journal
and yields; batch waits here until the cap, with hysteresis, lets it back in: after a
fixed cool-down, or (`priced`) a calm priced from this engine's own recent calm spells and
what its resumptions cost (`policy.preemption.resume_after`). The fleet
controller may cap batch lower still while the engine's pool surges (`direct`). Neither
keeps batch below its minimum share (`min_share` of the slots) for longer than
`starve_after_s`: continuous chat slows batch down, it never stops it.

Generations waiting for a slot due within URGENT_S take them earliest deadline first
(their batch's completion window's end; then arrival), as completion windows are promised
(policy/promises.py): a batch due in an hour is not stuck behind one due tomorrow. The
rest, and work with no window (a fine-tuning chunk), take turns by tenant (the one granted
a slot least lately first), each tenant's by arrival: one tenant's day-long backlog,
hundreds of its items asking at once, neither starves another tenant's batch nor a
fine-tuning job.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import statistics
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from policy.preemption import (
    Floor,
    Running,
    SlotDemand,
    SlotState,
    batch_slots,
    min_slots,
    resume_after,
    starvation_floor,
    victims,
)

# Work due within this long (half of OpenAI's 24h window) waits for a slot by its deadline;
# the rest, and work without a window, by tenant in turn, then arrival.
URGENT_S = 43_200.0
SPELLS = 32  # the calm spells between chats that price the next wait: about the last minute's
PENALTY_S = 0.5  # a resumption's cost until this engine has measured some


@dataclass
class BatchHold:
    id: str
    tier: int
    started_at: float
    abort: Callable[[], Awaitable[None]]  # stops the generation in the engine
    unsaved: int = 0
    generated: int = 0
    preempted_at: float | None = None  # when the decision was taken (monotonic)
    preempted: asyncio.Event = field(default_factory=asyncio.Event)


class Waiter(NamedTuple):
    """A generation waiting for a slot. Ordered (urgent ones, in their heap) by deadline,
    then arrival, which is unique."""

    deadline: float
    arrival: int
    owner: str
    urgent: bool


@dataclass
class SlotStats:
    preemptions: int = 0
    # The latest preemptions: (hold id, seconds from the decision to the slot's release),
    # how long interactive work waited for batch or training to yield.
    yields: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=1000))


class EngineSlots:
    def __init__(self, max_seqs: int, *, busy_cap: int = 0, cool_down_s: float = 2.0, min_share: float = 0.0,
                 starve_after_s: float = 30.0, preemption: bool = True, max_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, report_window: int = 3, priced: bool = False,
                 spare: int = 0):
        self.max_seqs = max_seqs
        # Sequences vLLM runs beyond max_seqs: a reserved tenant's request taking back a lent
        # slot starts on one at the next step, so the generation on that slot runs on.
        self.spare = spare
        self.busy_cap = busy_cap
        self.batch_max = None if max_share >= 1 else min_slots(max_share, max_seqs)
        self.cool_down_s = cool_down_s
        self.priced = priced
        self.wait_s = cool_down_s  # the calm to wait before batch takes back what chat left
        self.spells: deque[float] = deque(maxlen=SPELLS)  # calm spells between interactive work, seconds
        self.resume_costs: deque[float] = deque(maxlen=SPELLS)  # a resumed generation's slot to its first token
        self._calm_at: float | None = None  # when interactive work last ended, while none is in flight
        # False: batch keeps what it holds and takes any free slot; interactive work goes
        # ahead only by vLLM's priority scheduling (no caps, no preemption, no fleet cap).
        self.preemption = preemption
        self.clock = clock
        self.state = SlotState(cap=max_seqs)
        self.min_share = min_share
        self.floor = Floor(min_slots(min_share, max_seqs))
        self.starve_after_s = starve_after_s
        self._cap = max_seqs
        self.fleet_cap: int | None = None  # the fleet controller's, while the pool surges
        self.interactive = 0
        self.lendable = 0  # reserved slots their tenants leave unused: batch's while they do
        self.taken = 0  # reserved slots their tenants' requests hold
        self.interactive_peak = 0  # most in flight at once since the last report
        # In flight now by the API process that sent them: each API places by its own
        # streams (current) plus the others' (as of this report), not by the peak.
        self.by_source: Counter[str] = Counter()
        self._peaks: deque[int] = deque(maxlen=report_window)  # of the last few reports
        self.holds: dict[str, BatchHold] = {}
        self._busy_s = 0.0  # seconds batch work held a slot, up to `_busy_since`
        self._busy_since: float | None = None  # while some does
        self.queued = 0  # batch generations waiting here for a slot: the engine's queue depth
        self.stats = SlotStats()
        self._changed = asyncio.Condition()
        self._urgent: list[Waiter] = []  # due within URGENT_S: a heap, by deadline then arrival
        self._by_owner: dict[str, deque[Waiter]] = {}  # the rest, by tenant, each by arrival
        self._granted: dict[str, int] = {}  # each tenant's latest slot, as a count of slots granted
        self._grants = itertools.count()
        self._gave_up: set[Waiter] = set()  # waiters cancelled while queued
        self._arrivals = itertools.count()

    @asynccontextmanager
    async def interactive_request(self, source: str = "", seqs: int = 1) -> AsyncIterator[None]:
        """An interactive request for the block: `seqs` sequences of vLLM's (its `n`)."""
        if not self.interactive and self._calm_at is not None:
            self.spells.append(self.clock() - self._calm_at)
            self._calm_at = None
        self.interactive += seqs
        self.interactive_peak = max(self.interactive_peak, self.interactive)
        self.by_source[source] += seqs
        await self._rebalance()
        try:
            yield
        finally:
            self.interactive -= seqs
            self.by_source[source] -= seqs
            if not self.by_source[source]:
                del self.by_source[source]
            if not self.interactive:
                self._calm_at = self.clock()
                if self.priced:
                    penalty = statistics.median(self.resume_costs) if self.resume_costs else PENALTY_S
                    self.wait_s = resume_after(self.spells, penalty, self.cool_down_s)
            await self._rebalance()

    @asynccontextmanager
    async def batch(self, id: str, tier: int, abort: Callable[[], Awaitable[None]],
                    deadline: float | None = None, owner: str = "") -> AsyncIterator[BatchHold]:
        """Wait for a batch slot, hold it for the block. Cancellable while waiting. Waiters
        due within URGENT_S go by `deadline` (unix seconds; None: no window), ahead of the
        rest, whose `owner`s (tenants) take turns, each owner's by arrival."""
        urgent = deadline is not None and deadline - time.time() <= URGENT_S
        async with self._changed:
            self.queued += 1
            me = Waiter(deadline if urgent and deadline is not None else 0.0, next(self._arrivals), owner, urgent)
            if urgent:
                heapq.heappush(self._urgent, me)
            else:
                self._by_owner.setdefault(owner, deque()).append(me)
            try:
                while True:
                    self._update_cap()
                    if not self.preemption or (len(self.holds) < self.cap and self._first() == me):
                        break
                    # Re-check on every change, and when the cool-down or the floor's grace
                    # ends: hundreds of waiters must not poll while chat holds the engine.
                    # asyncio.timeout, not wait_for: wait_for waits in a task of its own, and
                    # a cancel landing as its timeout fires left that task to take the lock
                    # back after this one had gone, holding it for ever (every hold, chat
                    # and announce of the engine then blocked). Here the wait is this task's
                    # own, and it has the lock back before any exception leaves it.
                    try:
                        async with asyncio.timeout(self._next_change()):
                            await self._changed.wait()
                    except TimeoutError:
                        pass
            except BaseException:
                self._gave_up.add(me)
                self._changed.notify_all()  # it may have been the first: the next one goes
                raise
            finally:
                self.queued -= 1
            if self._first() == me:
                self._dequeue(me)
            else:  # no caps (preemption off): taken out of turn
                self._gave_up.add(me)
            self._changed.notify_all()  # the next waiter may take the next slot
            hold = BatchHold(id, tier, self.clock(), abort)
            self.holds[id] = hold
            self._granted[owner] = next(self._grants)
            if self._busy_since is None:
                self._busy_since = hold.started_at
        try:
            yield hold
        finally:
            self.holds.pop(id, None)
            if not self.holds and self._busy_since is not None:
                self._busy_s += self.clock() - self._busy_since
                self._busy_since = None
            if hold.preempted_at is not None:
                self.stats.yields.append((id, self.clock() - hold.preempted_at))
            async with self._changed:
                self._changed.notify_all()

    def _first(self) -> Waiter | None:
        """The waiter whose turn it is: the urgent by deadline; else the head of the tenant
        granted a slot least lately (never: first), the earliest head on a tie — the tenants
        waiting take turns."""
        while self._urgent and self._urgent[0] in self._gave_up:
            self._gave_up.discard(heapq.heappop(self._urgent))
        if self._urgent:
            return self._urgent[0]
        heads = []
        for owner, q in list(self._by_owner.items()):
            while q and q[0] in self._gave_up:
                self._gave_up.discard(q.popleft())
            if q:
                heads.append(q[0])
            else:
                del self._by_owner[owner]
        return min(heads, key=lambda w: (self._granted.get(w.owner, -1), w.arrival), default=None)

    def _dequeue(self, me: Waiter) -> None:
        """`me`, first in its queue, leaves it."""
        if me.urgent:
            heapq.heappop(self._urgent)
        else:
            q = self._by_owner[me.owner]
            q.popleft()
            if not q:
                del self._by_owner[me.owner]

    def busy_s(self) -> float:
        """Seconds so far that batch work held a slot here: the time a batch pace is over."""
        return self._busy_s + (self.clock() - self._busy_since if self._busy_since is not None else 0.0)

    def resumed(self, hold: BatchHold) -> None:
        """A resumed generation's first token is out: what its resumption cost (its slot to
        now: re-prefilling its prompt and tokens), a price for the next wait."""
        self.resume_costs.append(self.clock() - hold.started_at)

    @property
    def cap(self) -> int:
        """Batch sequences allowed now: the engine's own cap, or the fleet's if lower, but
        not below batch's floor once it has starved for `starve_after_s`."""
        return self._cap

    @property
    def by_floor(self) -> bool:
        """Batch holds slots now only by its floor: chat (or a surge) left it none."""
        return self._plain_cap() < self._cap

    async def lend(self, slots: int, taken: int = 0) -> None:
        """Reserved slots now unused (engine/fair_share.py), and those their tenants hold:
        the unused are lent to batch. Asked for, batch yields them at once: the cap falls,
        and its victims are aborted beyond the `parked` few left to end on their own."""
        if (slots, taken) != (self.lendable, self.taken):
            self.lendable, self.taken = slots, taken
            await self._rebalance()

    @property
    def parked(self) -> int:
        """Batch generations over the cap left running: as many as the spare sequences give
        the reserved slots taken back. The tenant's requests run beside them (vLLM's
        priority puts them first), batch gets no new slot until they end, and nothing is
        aborted, flushed and re-prefilled for a slot that may be lent again a moment later."""
        return min(self.spare, self.taken)

    async def direct(self, fleet_cap: int | None) -> None:
        """Apply the fleet controller's cap (None lifts it)."""
        if fleet_cap != self.fleet_cap:
            self.fleet_cap = fleet_cap
        await self._rebalance()  # also when unchanged: the floor's grace may have passed

    def snapshot(self) -> dict:
        return dict(interactive=self.interactive, batch=len(self.holds), batch_queued=self.queued, batch_cap=self.cap,
                    fleet_cap=self.fleet_cap, preemptions=self.stats.preemptions)

    def report(self) -> dict:
        """The snapshot, with interactive load as its peak over the last `report_window`
        reports: a once-a-second sample would miss most short chat requests, and the fleet
        controller, which reads only the latest report on its own tick, would miss the
        reports it ticks past."""
        self._peaks.append(self.interactive_peak)
        self.interactive_peak = self.interactive
        return dict(self.snapshot(), interactive=max(self._peaks), interactive_by=dict(self.by_source))

    def _next_change(self) -> float | None:
        """Seconds until the cap may change with no event (the cool-down or the floor's
        grace ends; the fleet controller's every tick is an event too); None when only an
        event can change it."""
        now, pending = self.clock(), []
        if self.state.calm_since is not None:
            pending.append(self.state.calm_since + self.wait_s - now)
        if self.floor.squeezed_since is not None:
            pending.append(self.floor.squeezed_since + self.starve_after_s - now)
        return min(5.0, max(0.01, min(pending))) if pending else None

    def _update_cap(self) -> None:
        demand = SlotDemand(self.interactive, self.max_seqs, self.busy_cap, self.batch_max, self.lendable)
        now = self.clock()
        self.state = batch_slots(demand, self.state, now, self.wait_s)
        self._cap, self.floor = starvation_floor(self._plain_cap(), self.floor, now, self.starve_after_s)

    def _plain_cap(self) -> int:
        """The cap but for the floor: the engine's own, under the fleet's while the pool
        surges. A surge caps the shared slots; the unused reserved ones that can be taken
        back without an abort (spare sequences) are lent on top of it."""
        if self.fleet_cap is None:
            return self.state.cap
        return min(self.state.cap, self.fleet_cap + min(self.lendable, self.spare))

    async def _rebalance(self) -> None:
        async with self._changed:
            self._update_cap()
            self._changed.notify_all()
        if not self.preemption:
            return
        live = [h for h in self.holds.values() if h.preempted_at is None]
        running = [Running(h.id, h.tier, h.unsaved, h.generated, h.started_at) for h in live]
        for id in victims(running, self.cap + self.parked):
            hold = self.holds[id]
            hold.preempted_at = self.clock()
            hold.preempted.set()
            self.stats.preemptions += 1
            await hold.abort()
