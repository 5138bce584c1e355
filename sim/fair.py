"""One engine's interactive queue in virtual time, as engine/fair_share.py keeps it with
`mode="vtc"`: the real `policy.fairness` decides, this holds its state.

The call sequence is the engine worker's: a request reaching the engine `enter`s (its
tenant `activate`d when it had nothing here) and waits in its (tier, tenant) FIFO; when a
slot frees, `pick` over the FIFOs' heads chooses (starved tiers first, capped tenants held
back, then tier, least counter, arrival), the chosen is `charge`d its prompt at once and
holds the slot until it `leave`s (its tenant `deactivate`d when it has nothing left here).
Output tokens are charged as produced: the engine brings every running request's count up
to date (`produced`) before each read of the counters, which is when they matter.

Guards, as the engine worker's defaults (config/scheduling.py): `headroom` slots no
tenant may fill while another has been seen in the last `recent_s`; at most
`long_prefills` prompts over `long_prompt` tokens prefilling at once while more than one
tenant is about; a tier in `floors` gets its slots back once its oldest request has waited
`starve_after_s`. Reservations are not modelled (no trace has any).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import KeysView, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

from policy import fairness as vtc

T = TypeVar("T")


@dataclass(frozen=True)
class Waiter(Generic[T]):
    item: T
    tenant: str
    tier: str
    prompt: int
    seq: int
    since: float
    long: bool


class FairQueue(Generic[T]):
    def __init__(self, limit: int, *, headroom: int = 0, floors: Mapping[str, int] | None = None,
                 starve_after_s: float = 30.0, long_prompt: int = 0, long_prefills: int = 1,
                 recent_s: float = 60.0, cost: vtc.Cost = vtc.PAPER_COST):
        self.limit, self.headroom, self.recent_s, self.cost = max(1, limit), headroom, recent_s, cost
        self.floors, self.starve_after_s = dict(floors or {}), starve_after_s
        self.long_prompt, self.long_prefills = long_prompt, max(1, long_prefills)
        self.state = vtc.Vtc()
        self.queues: dict[tuple[str, str], deque[Waiter[T]]] = {}
        self.waiting = 0
        self.running_of: dict[str, int] = {}
        self.running_in: dict[str, int] = {}
        self.load: dict[str, int] = {}  # tenant → its requests waiting or running here
        self.seen: dict[str, float] = {}  # tenant → when it last arrived or left, oldest first
        self.prefilling_long = 0
        self._seq = itertools.count()

    def produced(self, tenant: str, tokens: int) -> None:
        if tokens:
            self.state = vtc.charge(self.state, tenant, output_tokens=tokens, cost=self.cost)

    def enter(self, item: T, tenant: str, tier: str, prompt: int, now: float) -> None:
        """A request reached the engine: its tenant is active here; it waits its turn."""
        self._saw(tenant, now)
        n = self.load.get(tenant, 0)
        self.load[tenant] = n + 1
        if not n:
            self.state = vtc.activate(self.state, tenant)
        long = 0 < self.long_prompt < prompt
        self.queues.setdefault((tier, tenant), deque()).append(
            Waiter(item, tenant, tier, prompt, next(self._seq), now, long))
        self.waiting += 1

    def pick(self, now: float, running: int) -> Waiter[T] | None:
        """The next request to take a slot (`running`: interactive requests holding one), charged its prompt."""
        if running >= self.limit or not self.waiting:
            return None
        long_held = self._long_held(now)
        heads = (vtc.Head(tenant, tier, q[0].seq) for (tier, tenant), q in self.queues.items()
                 if not (q[0].long and long_held))
        head = vtc.pick(self.state, heads, first=self._starved(now), capped=self._capped(now))
        if head is None:  # only capped tenants, or held long prompts, wait
            return None
        q = self.queues[(head.tier, head.tenant)]
        w = q.popleft()
        if not q:
            del self.queues[(head.tier, head.tenant)]
        self.waiting -= 1
        self.running_of[w.tenant] = self.running_of.get(w.tenant, 0) + 1
        self.running_in[w.tier] = self.running_in.get(w.tier, 0) + 1
        self.prefilling_long += w.long
        self.state = vtc.charge(self.state, w.tenant, input_tokens=w.prompt, cost=self.cost)
        return w

    def first_token(self, long: bool) -> None:
        """Its prefill is over: a long prompt's place frees."""
        self.prefilling_long -= long

    def leave(self, tenant: str, tier: str, now: float) -> None:
        """A request that held a slot is done."""
        for counts, k in ((self.running_of, tenant), (self.running_in, tier)):
            counts[k] -= 1
            if not counts[k]:
                del counts[k]
        self._saw(tenant, now)
        n = self.load[tenant] - 1
        if n:
            self.load[tenant] = n
        else:
            del self.load[tenant]
            self.state = vtc.deactivate(self.state, tenant)
            self._forget()

    def _forget(self) -> None:
        """Drop the counters of inactive tenants at or under the least active one: `least`
        never falls, so on activating they are lifted to it as a new tenant is (the engine
        worker keeps them; dropping them changes nothing but the cost of each charge)."""
        v = self.state
        if len(v.counters) < 2 * len(v.active) + 64:
            return
        least = v.least()
        kept = {t: c for t, c in v.counters.items() if t in v.active or c > least}
        self.state = vtc.Vtc(MappingProxyType(kept), v.active, v.floor)

    def _saw(self, tenant: str, now: float) -> None:
        self.seen.pop(tenant, None)
        self.seen[tenant] = now

    def _about(self, now: float) -> KeysView[str]:
        """Tenants active here or seen in the last `recent_s`: the stale ones drop off the
        front (an active one goes to the back instead, stamped now: it is about until it
        leaves, and leaving stamps it again)."""
        horizon = now - self.recent_s
        seen = self.seen
        while seen:
            tenant, at = next(iter(seen.items()))
            if at >= horizon:
                break
            del seen[tenant]
            if tenant in self.load:
                seen[tenant] = now
        return seen.keys()

    def _long_held(self, now: float) -> bool:
        return self.prefilling_long >= self.long_prefills and len(self._about(now)) > 1

    def _capped(self, now: float) -> frozenset[str]:
        if not self.headroom or not self.running_of:
            return frozenset()
        about = self._about(now)
        n = len(about)
        return frozenset(t for t, k in self.running_of.items()
                         if k >= vtc.tenant_cap(self.limit, self.headroom, others=n - (t in about) > 0))

    def _starved(self, now: float) -> frozenset[str]:
        if not self.floors:
            return frozenset()
        return vtc.starved(((tier, q[0].since) for (tier, _), q in self.queues.items()), self.running_in,
                           self.floors, now, self.starve_after_s)
