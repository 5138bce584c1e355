"""Tenant fair shares on one engine worker: the Virtual Token Counter's state and queue.

`policy.fairness` decides; this holds its state for the engine worker and applies it to
interactive requests. With `mode="vtc"` (BALLAST_FAIR_SHARE, the default) at most
`limit` interactive requests (the engine's sequence slots) are in vLLM at once; the
others wait here, and each time one ends the next is chosen by `policy.fairness.pick`:
highest tier first, then the tenant served least (its counter), then arrival. A tenant
is active while it has requests waiting or running here; one that had none is lifted on
arrival to the least active counter. (The paper's stricter rule, active only while it
has requests waiting, lifts a closed-loop tenant each time its queue empties between a
request and its successor, and so charges it for its own turnaround; one run of
`ballast bench fairness` with it gave Jain's index per window 0.73–0.99, no better than
this rule's runs. The price of this rule: a tenant that keeps a few requests running,
but never waiting, banks credit it can spend later in a burst.) Choosing
when a slot frees, not when the request arrives, is what keeps the counters close: a
vLLM priority fixed at arrival would go stale while the request waits. Each dispatched
request still carries a vLLM priority (`engine_priority`: its tier, then its rank) for
what vLLM orders itself (KV-cache pressure). Below `limit` nothing waits: one dict
update per request and per engine step, no I/O.

Three guards before that order. Headroom: while another tenant has been seen in the last
minute, no tenant holds more than `limit − headroom` slots, so another tenant's request
starts at once instead of queuing behind, say, a tenant of giant prompts (a lone tenant
keeps every slot). Long prefills: meanwhile at most `long_prefills` prompts longer than
`long_prompt` are prefilling at once (until their first token), so giant prompts cannot
fill every engine step with prefill work that another tenant's first token waits behind
(vLLM's chunked prefill bounds each prompt's share of a step; this bounds how many).
Floors: a tier with a minimum share (flex) whose oldest request has waited
`starve_after_s` goes first until it holds its share, so continuous chat slows flex but
never stops it, as batch's floor does for batch (policy/preemption.py).

Reservations (`reserve`: tenant → slots on this engine, policy/reservations.py) come
before all three: a tenant's request inside its reservation goes first, at the highest
vLLM priority, and the part of each reservation its tenant is not using is held back from
every other tenant's requests, so it is free the moment its tenant asks. Meanwhile it is
lent to batch (`lending`: EngineSlots.lend), which yields it when the tenant's request
takes it.

Bounds on the wait (`bounds`: tier → seconds): a request that would queue, and whose
expected wait passes its tier's bound, is refused before it is accepted (`over_bound`);
the API tries the pool's other engines, then answers 429. One that queued and has waited
its bound without a slot is refused then (`WaitedPastBound`), so none waits longer. The
wait (`expected_wait`, policy.fairness) is reckoned from the requests ahead of it (those
of its tier and above, and any inside a reservation), the mean time the last `HOLDS`
requests held a slot, and the rate at which requests that go before it (higher tiers,
reservations) arrived in the last `RATE_WINDOW_S`; for a tier with a floor, at most the
floor's own pace. Never a request inside its tenant's reservation, and nothing until
`HOLDS_BEFORE_BOUND` holds are measured.

With `mode="fcfs"` requests go to vLLM at once with the priority the API sent (the
tier's), served by arrival within a tier, as before; the counters are still kept, so
`/stats` shows what each tenant got either way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, KeysView, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from policy import fairness as vtc
from policy import reservations
from protocol.tiers import RANK, Tier

Mode = Literal["vtc", "fcfs"]
_TIER_OF = {v: k for k, v in RANK.items()}
HOLDS = 64  # the slot holds whose mean is the expected wait's hold time
HOLDS_BEFORE_BOUND = 8  # fewer measured: no estimate, nothing refused for the wait
RATE_WINDOW_S = 10.0  # the arrivals whose rate the expected wait counts
INSIDE = -1  # the class of a request inside its tenant's reservation: before every tier


class WaitedPastBound(Exception):
    """A request waited its tier's bound for a slot and is refused (it gets none)."""

    def __init__(self, tier: str, bound_s: float):
        super().__init__(f"This request waited {bound_s:g} s for a sequence slot on this engine, the bound on the "
                         f"{tier} tier's wait, and did not get one; try again.")
        self.tier, self.bound_s = tier, bound_s


@dataclass
class _Waiter:
    tenant: str
    tier: str
    weight: float
    prompt_tokens: int
    seq: int
    since: float  # when it began to wait
    long: bool  # a prompt past `long_prompt`: one of the few prefilled at a time while others are about
    granted: asyncio.Future[int]  # its vLLM priority, once dispatched


class Turn:
    """One interactive request's time on the engine: its vLLM priority, and what it is charged."""

    def __init__(self, share: FairShare, tenant: str, weight: float, priority: int, long: bool = False):
        self.share, self.tenant, self.weight, self.priority = share, tenant, weight, priority
        self.prefilling = long  # a long prompt's prefill holds one of the long-prefill places

    def produced(self, tokens: int) -> None:
        if tokens:
            self.share.charge(self.tenant, self.weight, output_tokens=tokens)
            self.prefilled()

    def prefilled(self) -> None:
        """Its first token is out (or it ended without one): its prefill's place frees."""
        if self.prefilling:
            self.prefilling = False
            self.share.long_prefill_done()


class FairShare:
    """`headroom`: slots a tenant leaves free while another tenant has been seen in the
    last `recent_s`; `floors`: tier → the slots it gets back once one of its requests has
    waited `starve_after_s` (a minimum share: flex under continuous chat); `bounds`: tier →
    the longest a request of it waits for a slot (0 or absent: no bound)."""

    def __init__(self, mode: Mode = "vtc", limit: int = 256, cost: vtc.Cost = vtc.PAPER_COST,
                 quantum: float = vtc.QUANTUM, *, headroom: int = 0, recent_s: float = 60.0,
                 floors: Mapping[str, int] | None = None, starve_after_s: float = 30.0,
                 long_prompt: int = 0, long_prefills: int = 1, bounds: Mapping[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.mode, self.limit, self.cost, self.quantum = mode, max(1, limit), cost, quantum
        self.headroom, self.recent_s, self.clock = headroom, recent_s, clock
        self.floors, self.starve_after_s = dict(floors or {}), starve_after_s
        self.long_prompt, self.long_prefills = long_prompt, max(1, long_prefills)
        self.prefilling_long = 0  # long prompts dispatched whose first token is not out yet
        self.bounds = dict(bounds or {})
        self.holds: deque[float] = deque(maxlen=HOLDS)  # how long the last requests held their slot (s)
        self.shed_by: dict[str, int] = {}  # tier → requests refused for their expected wait
        self.expired_by: dict[str, int] = {}  # tier → requests that waited their tier's bound and were refused then
        self.arrivals: deque[tuple[float, int]] = deque()  # (when, its class: INSIDE or its tier's order)
        self.arrived: dict[int, int] = {}  # class → its arrivals in `arrivals`
        self.state = vtc.Vtc()
        self.running = 0  # interactive requests dispatched to vLLM (vtc mode)
        self.running_of: dict[str, int] = {}  # tenant → its requests dispatched
        self.running_in: dict[str, int] = {}  # tier → its requests dispatched
        self.seen: dict[str, float] = {}  # tenant → when it last arrived or left
        self.served: dict[str, float] = {}  # tenant → weighted tokens given (the counter without its lifts)
        # tenant → slots it got while an active tenant served less had nothing waiting: the
        # work-conserving grants that VTC's bound for backlogged tenants does not cover
        self.out_of_turn: dict[str, int] = {}
        self.load: dict[str, int] = {}  # tenant → its requests waiting or running here ("active")
        self.queued_of: dict[str, int] = {}  # tenant → its requests waiting here
        self.queues: dict[tuple[str, str], deque[_Waiter]] = {}  # (tier, tenant) → FIFO
        self.waiting = 0
        self.queued_total = 0  # requests that ever waited here for a slot
        self.queued_by: dict[str, int] = {}  # … by tenant
        self.reserved: dict[str, int] = {}  # tenant → slots of this engine reserved for it
        # Told after every change the reserved slots left unused (batch's meanwhile) and those
        # their tenants hold (EngineSlots.lend).
        self.lending: Callable[[int, int], Coroutine[Any, Any, None]] | None = None
        self._lent = (0, 0)
        self._lends: set[asyncio.Task] = set()
        self._seq = itertools.count()

    def reserve(self, reserved: Mapping[str, int]) -> None:
        """The reservations in force on this engine now (tenant → slots)."""
        if reserved != self.reserved:
            self.reserved = dict(reserved)
            self._dispatch()
            self._lend()

    def _lend(self) -> None:
        """Tell the slots what is left unused of the reservations and what is taken, when it changed."""
        lent = (sum(reservations.unused(self.reserved, self.running_of).values()),
                sum(reservations.used(self.reserved, self.running_of).values()))
        if self.lending is None or lent == self._lent:
            return
        self._lent = lent
        task = asyncio.get_running_loop().create_task(self.lending(*lent))
        self._lends.add(task)
        task.add_done_callback(self._lends.discard)

    def _room(self, tenant: str) -> bool:
        """A slot `tenant` may take now: one not held back for another's reservation."""
        return self.running < self.limit - reservations.held_back(self.reserved, self.running_of, tenant)

    def charge(self, tenant: str, weight: float, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
        before = self.state.counter(tenant)
        self.state = vtc.charge(self.state, tenant, input_tokens=input_tokens, output_tokens=output_tokens,
                                weight=weight, cost=self.cost)
        self.served[tenant] = self.served.get(tenant, 0.0) + self.state.counter(tenant) - before

    @asynccontextmanager
    async def turn(self, tenant: str, tier: str | None, weight: float, prompt_tokens: int,
                   fallback_priority: int) -> AsyncIterator[Turn]:
        """Wait (vtc, engine full) for this request's turn; hold it for the block.
        `tier` None (a job from an older API): the tier the API's priority names."""
        tier = tier if tier in RANK else _TIER_OF.get(fallback_priority, "default")
        weight = weight if weight > 0 else 1.0
        if self.mode == "fcfs":  # counted (for /stats), never held
            self.charge(tenant, weight, input_tokens=prompt_tokens)
            yield Turn(self, tenant, weight, fallback_priority)
            return
        self._enter(tenant)
        inside = reservations.within(self.reserved, self.running_of, tenant)
        self._arrived(INSIDE if inside else vtc.tier_order(tier))
        long = 0 < self.long_prompt < prompt_tokens
        try:
            priority = await self._wait(tenant, tier, weight, prompt_tokens, long,
                                        None if inside else self.bounds.get(tier) or None)
            turn = Turn(self, tenant, weight, priority, long)
            granted = self.clock()
            try:
                yield turn
            finally:
                turn.prefilled()
                self.holds.append(self.clock() - granted)
                self._release(tenant, tier)
        finally:
            self._leave(tenant)

    def _grant(self, tenant: str, tier: str, weight: float, prompt_tokens: int, long: bool) -> int:
        """Dispatch: a slot taken, the prompt charged at once (before the next pick), and
        the vLLM priority from the tenant's rank as it was."""
        reserved = reservations.within(self.reserved, self.running_of, tenant)
        self.running += 1
        self.prefilling_long += long
        self.running_of[tenant] = self.running_of.get(tenant, 0) + 1
        self.running_in[tier] = self.running_in.get(tier, 0) + 1
        priority = (vtc.engine_priority(Tier.PRIORITY) if reserved
                    else vtc.engine_priority(tier, vtc.rank(self.state, tenant, self.quantum)))
        mine = self.state.counter(tenant)
        if any(t != tenant and t not in self.queued_of and self.state.counter(t) < mine for t in self.load):
            self.out_of_turn[tenant] = self.out_of_turn.get(tenant, 0) + 1
        self.charge(tenant, weight, input_tokens=prompt_tokens)
        if reserved:
            self._lend()
        return priority

    def _release(self, tenant: str, tier: str) -> None:
        self.running -= 1
        for counts, k in ((self.running_of, tenant), (self.running_in, tier)):
            counts[k] -= 1
            if not counts[k]:
                del counts[k]
        self._dispatch()
        if tenant in self.reserved:
            self._lend()

    def long_prefill_done(self) -> None:
        self.prefilling_long -= 1
        self._dispatch()

    def _long_held(self) -> bool:
        """Long prompts wait for a place: as many as `long_prefills` are prefilling while
        more than one tenant is about (alone, a tenant's long prompts all go at once)."""
        return self.prefilling_long >= self.long_prefills and len(self._about(self.clock())) > 1

    async def _wait(self, tenant: str, tier: str, weight: float, prompt_tokens: int, long: bool,
                    bound: float | None = None) -> int:
        """Its vLLM priority, once dispatched; WaitedPastBound where it waited `bound` seconds."""
        now = self.clock()
        if (self._room(tenant) and not self.waiting and tenant not in self._capped(now)
                and not (long and self._long_held())):
            return self._grant(tenant, tier, weight, prompt_tokens, long)
        w = _Waiter(tenant, tier, weight, prompt_tokens, next(self._seq), now, long,
                    asyncio.get_running_loop().create_future())
        self.queues.setdefault((tier, tenant), deque()).append(w)
        self.queued_of[tenant] = self.queued_of.get(tenant, 0) + 1
        self.waiting += 1
        self._dispatch()
        if not w.granted.done():  # it waits (one behind capped tenants only is dispatched at once)
            self.queued_total += 1
            self.queued_by[tenant] = self.queued_by.get(tenant, 0) + 1
        try:
            try:
                return await (asyncio.wait_for(w.granted, bound) if bound else w.granted)
            except TimeoutError:
                self.expired_by[tier] = self.expired_by.get(tier, 0) + 1
                raise WaitedPastBound(tier, bound or 0.0) from None
        except BaseException:
            if w.granted.done() and not w.granted.cancelled():  # granted, then cancelled: give it back
                self.prefilling_long -= long
                self._release(tenant, tier)
            else:
                self._drop(w)
            raise

    def _drop(self, w: _Waiter) -> None:
        q = self.queues.get((w.tier, w.tenant))
        if q is not None and w in q:
            q.remove(w)
            if not q:
                del self.queues[(w.tier, w.tenant)]
            self._unqueued(w.tenant)

    def _about(self, now: float) -> KeysView[str]:
        """Tenants active here or seen in the last `recent_s`."""
        horizon = now - self.recent_s
        for t in [t for t, at in self.seen.items() if at < horizon and t not in self.load]:
            del self.seen[t]
        return self.seen.keys()

    def _capped(self, now: float) -> frozenset[str]:
        """Tenants holding all the slots one tenant may hold now."""
        if not self.headroom or not self.running_of:
            return frozenset()
        about = self._about(now)
        return frozenset(t for t, n in self.running_of.items()
                         if n >= vtc.tenant_cap(self.limit, self.headroom, others=len(about - {t}) > 0))

    def _starved(self, now: float) -> frozenset[str]:
        """Tiers below their floor whose oldest waiting request has waited long enough."""
        if not self.floors:
            return frozenset()
        return vtc.starved(((tier, q[0].since) for (tier, _), q in self.queues.items()), self.running_in,
                           self.floors, now, self.starve_after_s)

    def _dispatch(self) -> None:
        while self.running < self.limit and self.waiting:
            now = self.clock()
            long_held = self._long_held()
            heads = (vtc.Head(t, tier, q[0].seq) for (tier, t), q in self.queues.items()
                     if not (q[0].long and long_held) and self._room(t))
            inside = frozenset(t for t in self.reserved if reservations.within(self.reserved, self.running_of, t))
            head = vtc.pick(self.state, heads, first=self._starved(now), capped=self._capped(now), reserved=inside)
            if head is None:  # only capped tenants, or held long prompts, wait
                return
            q = self.queues[(head.tier, head.tenant)]
            w = q.popleft()
            if not q:
                del self.queues[(head.tier, head.tenant)]
            if not w.granted.done():  # else cancelled while waiting: its task drops nothing more
                w.granted.set_result(self._grant(w.tenant, w.tier, w.weight, w.prompt_tokens, w.long))
            self._unqueued(w.tenant)

    def _unqueued(self, tenant: str) -> None:
        self.waiting -= 1
        n = self.queued_of[tenant] - 1
        if n:
            self.queued_of[tenant] = n
        else:
            del self.queued_of[tenant]

    def _enter(self, tenant: str) -> None:
        self.seen[tenant] = self.clock()
        n = self.load.get(tenant, 0)
        self.load[tenant] = n + 1
        if not n:
            self.state = vtc.activate(self.state, tenant)

    def _leave(self, tenant: str) -> None:
        self.seen[tenant] = self.clock()
        n = self.load[tenant] - 1
        if n:
            self.load[tenant] = n
        else:
            del self.load[tenant]
            self.state = vtc.deactivate(self.state, tenant)

    def hold_s(self) -> float | None:
        """The mean time the last requests held their slot; None before enough are measured."""
        return sum(self.holds) / len(self.holds) if len(self.holds) >= HOLDS_BEFORE_BOUND else None

    def expected_wait(self, tenant: str, tier: str | None) -> float | None:
        """How long a request of `tenant` in `tier` arriving now would wait for its slot:
        0 where it starts at once or runs inside its tenant's reservation; None where the
        engine cannot tell (no queue kept here, too few holds measured)."""
        tier = tier if tier in RANK else Tier.DEFAULT
        if self.mode == "fcfs":
            return None
        if (self._room(tenant) and not self.waiting) or reservations.within(self.reserved, self.running_of, tenant):
            return 0.0
        hold = self.hold_s()
        if hold is None:
            return None
        inside = {t for t in self.reserved if reservations.within(self.reserved, self.running_of, t)}
        mine = vtc.tier_order(tier)
        ahead = sum(len(q) for (t, who), q in self.queues.items() if who in inside or vtc.tier_order(t) <= mine)
        self._arrived(None)
        before = sum(n for c, n in self.arrived.items() if c < mine) / RATE_WINDOW_S
        own = sum(len(q) for (t, _), q in self.queues.items() if t == tier)
        return min(vtc.expected_wait(ahead, self.limit, hold, before),
                   vtc.floor_wait(own, self.floors.get(tier, 0), hold, self.starve_after_s))

    def _arrived(self, cls: int | None) -> None:
        """A request of class `cls` arrived now (None: none did); the window moved on."""
        now = self.clock()
        if cls is not None:
            self.arrivals.append((now, cls))
            self.arrived[cls] = self.arrived.get(cls, 0) + 1
        while self.arrivals and self.arrivals[0][0] < now - RATE_WINDOW_S:
            self.arrived[self.arrivals.popleft()[1]] -= 1

    def over_bound(self, tenant: str, tier: str | None) -> int | None:
        """Retry-After (s) where a request of `tenant` in `tier` would wait past its tier's
        bound (it is counted as shed); None: it may queue."""
        tier = tier if tier in RANK else Tier.DEFAULT
        wait = self.expected_wait(tenant, tier)
        retry = None if wait is None else vtc.shed(wait, self.bounds.get(tier, 0.0))
        if retry is not None:
            self.shed_by[tier] = self.shed_by.get(tier, 0) + 1
        return retry

    def in_tier(self, tier: str) -> int:
        """Requests of `tier` running or waiting here."""
        return self.running_in.get(tier, 0) + sum(len(q) for (t, _), q in self.queues.items() if t == tier)

    def snapshot(self) -> dict:
        waiting: dict[str, int] = {}
        for (_, tenant), q in self.queues.items():
            waiting[tenant] = waiting.get(tenant, 0) + len(q)
        return dict(mode=self.mode, limit=self.limit, running=self.running, waiting=waiting,
                    running_of=dict(sorted(self.running_of.items())), running_in=dict(sorted(self.running_in.items())),
                    queued_total=self.queued_total, queued_by=dict(sorted(self.queued_by.items())),
                    active=sorted(self.state.active),
                    counters={t: round(c, 1) for t, c in sorted(self.state.counters.items())},
                    served={t: round(c, 1) for t, c in sorted(self.served.items())},
                    out_of_turn=dict(sorted(self.out_of_turn.items())), prefilling_long=self.prefilling_long,
                    reserved=dict(sorted(self.reserved.items())), shed_by=dict(sorted(self.shed_by.items())),
                    expired_by=dict(sorted(self.expired_by.items())),
                    hold_s=None if (hold := self.hold_s()) is None else round(hold, 3))
