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

With `mode="fcfs"` requests go to vLLM at once with the priority the API sent (the
tier's), served by arrival within a tier, as before; the counters are still kept, so
`/stats` shows what each tenant got either way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from policy import fairness as vtc
from policy.preemption import TIERS

Mode = Literal["vtc", "fcfs"]
_TIER_OF = {v: k for k, v in TIERS.items()}


@dataclass
class _Waiter:
    tenant: str
    tier: str
    weight: float
    prompt_tokens: int
    seq: int
    granted: asyncio.Future[int]  # its vLLM priority, once dispatched


class Turn:
    """One interactive request's time on the engine: its vLLM priority, and what it is charged."""

    def __init__(self, share: FairShare, tenant: str, weight: float, priority: int):
        self.share, self.tenant, self.weight, self.priority = share, tenant, weight, priority

    def produced(self, tokens: int) -> None:
        if tokens:
            self.share.charge(self.tenant, self.weight, output_tokens=tokens)


class FairShare:
    def __init__(self, mode: Mode = "vtc", limit: int = 256, cost: vtc.Cost = vtc.PAPER_COST,
                 quantum: float = vtc.QUANTUM):
        self.mode, self.limit, self.cost, self.quantum = mode, max(1, limit), cost, quantum
        self.state = vtc.Vtc()
        self.running = 0  # interactive requests dispatched to vLLM (vtc mode)
        self.load: dict[str, int] = {}  # tenant → its requests waiting or running here ("active")
        self.queued_of: dict[str, int] = {}  # tenant → its requests waiting here
        self.queues: dict[tuple[str, str], deque[_Waiter]] = {}  # (tier, tenant) → FIFO
        self.waiting = 0
        self.queued_total = 0  # requests that ever waited here
        self._seq = itertools.count()

    def charge(self, tenant: str, weight: float, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
        self.state = vtc.charge(self.state, tenant, input_tokens=input_tokens, output_tokens=output_tokens,
                                weight=weight, cost=self.cost)

    @asynccontextmanager
    async def turn(self, tenant: str, tier: str | None, weight: float, prompt_tokens: int,
                   fallback_priority: int) -> AsyncIterator[Turn]:
        """Wait (vtc, engine full) for this request's turn; hold it for the block.
        `tier` None (a job from an older API): the tier the API's priority names."""
        tier = tier if tier in TIERS else _TIER_OF.get(fallback_priority, "default")
        weight = weight if weight > 0 else 1.0
        if self.mode == "fcfs":  # counted (for /stats), never held
            self.charge(tenant, weight, input_tokens=prompt_tokens)
            yield Turn(self, tenant, weight, fallback_priority)
            return
        self._enter(tenant)
        try:
            priority = await self._wait(tenant, tier, weight, prompt_tokens)
            try:
                yield Turn(self, tenant, weight, priority)
            finally:
                self.running -= 1
                self._dispatch()
        finally:
            self._leave(tenant)

    def _grant(self, tenant: str, tier: str, weight: float, prompt_tokens: int) -> int:
        """Dispatch: a slot taken, the prompt charged at once (before the next pick), and
        the vLLM priority from the tenant's rank as it was."""
        self.running += 1
        priority = vtc.engine_priority(tier, vtc.rank(self.state, tenant, self.quantum))
        self.charge(tenant, weight, input_tokens=prompt_tokens)
        return priority

    async def _wait(self, tenant: str, tier: str, weight: float, prompt_tokens: int) -> int:
        if self.running < self.limit and not self.waiting:
            return self._grant(tenant, tier, weight, prompt_tokens)
        w = _Waiter(tenant, tier, weight, prompt_tokens, next(self._seq), asyncio.get_running_loop().create_future())
        self.queues.setdefault((tier, tenant), deque()).append(w)
        self.queued_of[tenant] = self.queued_of.get(tenant, 0) + 1
        self.waiting += 1
        self.queued_total += 1
        self._dispatch()
        try:
            return await w.granted
        except BaseException:
            if w.granted.done() and not w.granted.cancelled():  # granted, then cancelled: give it back
                self.running -= 1
                self._dispatch()
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

    def _dispatch(self) -> None:
        while self.running < self.limit and self.waiting:
            heads = (vtc.Head(t, tier, q[0].seq) for (tier, t), q in self.queues.items())
            head = vtc.pick(self.state, heads)
            assert head is not None
            q = self.queues[(head.tier, head.tenant)]
            w = q.popleft()
            if not q:
                del self.queues[(head.tier, head.tenant)]
            if not w.granted.done():  # else cancelled while waiting: its task drops nothing more
                w.granted.set_result(self._grant(w.tenant, w.tier, w.weight, w.prompt_tokens))
            self._unqueued(w.tenant)

    def _unqueued(self, tenant: str) -> None:
        self.waiting -= 1
        n = self.queued_of[tenant] - 1
        if n:
            self.queued_of[tenant] = n
        else:
            del self.queued_of[tenant]

    def _enter(self, tenant: str) -> None:
        n = self.load.get(tenant, 0)
        self.load[tenant] = n + 1
        if not n:
            self.state = vtc.activate(self.state, tenant)

    def _leave(self, tenant: str) -> None:
        n = self.load[tenant] - 1
        if n:
            self.load[tenant] = n
        else:
            del self.load[tenant]
            self.state = vtc.deactivate(self.state, tenant)

    def snapshot(self) -> dict:
        waiting: dict[str, int] = {}
        for (_, tenant), q in self.queues.items():
            waiting[tenant] = waiting.get(tenant, 0) + len(q)
        return dict(mode=self.mode, limit=self.limit, running=self.running, waiting=waiting,
                    queued_total=self.queued_total, active=sorted(self.state.active),
                    counters={t: round(c, 1) for t, c in sorted(self.state.counters.items())})
