"""Tenant fair shares within a tier: the Virtual Token Counter. Pure: state in, state out.

Counting requests is not fair when requests differ in size (an 8,000-token prompt and a
100-token one are both "one request"), so an engine keeps, per tenant, a counter of the
service it gave: input tokens × `w_in` + output tokens × `w_out`, divided by the tenant's
weight (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24; input 1 and
output 2 are the paper's defaults). Its rules:

- `activate`: a tenant that becomes active (it had nothing waiting or running on the
  engine) is lifted to the least counter among the active tenants, or, when none is
  active, to the counter of the last tenant that left: idling banks no credit.
- `charge`: the prompt when the request is dispatched, each output token as the engine
  produces it.
- `pick`: when a sequence slot frees, the next request is the head of the highest tier
  that has one waiting, and within the tier that of the tenant with the least counter
  (then the earliest arrival): two backlogged tenants' counters then never drift further
  apart than a bound of about twice the largest request's cost (the paper's Theorem 4.4).
  Two guards sit in front of that order: a tier starved below its minimum share goes
  first (flex under continuous chat), and a tenant holding `tenant_cap` slots waits, so
  that a few slots stay free for another tenant's next request (a giant-prompt tenant
  cannot make a chat tenant queue behind it).

`expected_wait` and `shed` bound the queue: a request whose expected wait for a slot passes
its tier's bound is refused at once (a 429 the client may retry elsewhere or later) rather
than queued past any use. The wait counts the higher tiers' arrivals as well as the queue
ahead, since they go first as they come: under overload a tier whose betters take every
slot that frees is refused outright (a tier with a minimum share waits at most its
`floor_wait`), and lower tiers have the tighter bounds, so flex goes first, then default,
then priority.

`engine_priority` turns (tier, the tenant's rank: its counter above the least-served
active tenant, quantised) into one vLLM priority int (lower is served first) such that
every tier strictly precedes the next for any rank, and batch stays exactly at its own
`RANK[Tier.BATCH]` value, behind every interactive tier (the batch path and the engine gate
recognise batch by that value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from protocol.tiers import RANK, Tier

SPAN = 16  # vLLM priority values per interactive tier: ranks 0 … SPAN-1
QUANTUM = 256.0  # counter units (weighted tokens) per rank step
MAX_RETRY_S = 60  # the longest Retry-After a request refused for the wait is told


@dataclass(frozen=True)
class Cost:
    """What a token costs, by kind."""

    input: float = 1.0
    output: float = 2.0


PAPER_COST = Cost()  # the paper's defaults: input 1, output 2


@dataclass(frozen=True)
class Vtc:
    """One engine's counters. `active`: tenants with a request waiting or running on it;
    `floor`: the counter of the last tenant that left when the engine went idle."""

    counters: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    active: frozenset[str] = frozenset()
    floor: float = 0.0

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def least(self) -> float:
        """The least counter among the active tenants (the floor when none is)."""
        return min((self.counter(t) for t in self.active), default=self.floor)


@dataclass(frozen=True)
class Head:
    """The first waiting request of one (tier, tenant) queue."""

    tenant: str
    tier: str
    seq: int  # arrival order on this engine


def _with(counters: Mapping[str, float], tenant: str, value: float) -> Mapping[str, float]:
    return MappingProxyType({**counters, tenant: value})


def activate(v: Vtc, tenant: str) -> Vtc:
    """`tenant` has work on the engine again; lifted if it had left. Idempotent."""
    if tenant in v.active:
        return v
    lifted = max(v.counter(tenant), v.least())
    return Vtc(_with(v.counters, tenant, lifted), v.active | {tenant}, v.floor)


def deactivate(v: Vtc, tenant: str) -> Vtc:
    """`tenant` has nothing waiting or running on the engine any more."""
    if tenant not in v.active:
        return v
    active = v.active - {tenant}
    return Vtc(v.counters, active, v.floor if active else max(v.floor, v.counter(tenant)))


def charge(v: Vtc, tenant: str, *, input_tokens: int = 0, output_tokens: int = 0, weight: float = 1.0,
           cost: Cost = PAPER_COST) -> Vtc:
    """Service given to `tenant`: its counter grows by the weighted tokens over its weight."""
    if not input_tokens and not output_tokens:
        return v
    served = (input_tokens * cost.input + output_tokens * cost.output) / max(weight, 1e-9)
    return Vtc(_with(v.counters, tenant, v.counter(tenant) + served), v.active, v.floor)


def rank(v: Vtc, tenant: str, quantum: float = QUANTUM) -> int:
    """How far `tenant` is ahead of the least-served active tenant, in quanta (0: it is
    the least served, or within one quantum of it)."""
    return max(0, math.floor((v.counter(tenant) - v.least()) / quantum))


def tier_order(tier: str) -> int:
    return RANK.get(tier, RANK[Tier.DEFAULT])


def pick(v: Vtc, heads: Iterable[Head], *, first: frozenset[str] = frozenset(),
         capped: frozenset[str] = frozenset(), reserved: frozenset[str] = frozenset()) -> Head | None:
    """The request to dispatch next, None when every head is held back:
    1. heads of `reserved` tenants (inside their reservation) go first, by arrival;
    2. heads of `capped` tenants wait (they hold all the slots one tenant may hold);
    3. tiers in `first` (starved below their minimum share) go before the others;
    4. then the highest tier (lowest RANK value), the tenant with the least counter, the
       earliest arrival, the tenant id."""
    return min((h for h in heads if h.tenant in reserved or h.tenant not in capped),
               key=lambda h: (h.tenant not in reserved, h.tier not in first, tier_order(h.tier),
                              0.0 if h.tenant in reserved else v.counter(h.tenant), h.seq, h.tenant),
               default=None)


def tenant_cap(limit: int, headroom: int, others: bool) -> int:
    """The most slots one tenant may hold: all of them while no other tenant has been
    seen lately, else all but `headroom`, kept free so that another tenant's request
    starts at once instead of waiting for a slot to free (never below one)."""
    return limit if not others else max(1, limit - headroom)


def starved(heads: Iterable[tuple[str, float]], running_in: Mapping[str, int], floors: Mapping[str, int],
            now: float, after_s: float) -> frozenset[str]:
    """Tiers below their floor (`floors`: tier → slots) whose oldest waiting request has
    waited `after_s`; `heads`: (tier, since) of the request at the head of each queue."""
    oldest: dict[str, float] = {}
    for tier, since in heads:
        if tier in floors:
            oldest[tier] = min(oldest.get(tier, now), since)
    return frozenset(tier for tier, since in oldest.items()
                     if running_in.get(tier, 0) < floors[tier] and now - since >= after_s)


def engine_priority(tier: str, rank: int = 0, span: int = SPAN) -> int:
    """One vLLM priority (lower first): tiers in RANK order for any rank, ranks in order
    within a tier (clamped to span - 1), batch exactly at RANK[Tier.BATCH] after them all."""
    batch = RANK[Tier.BATCH]
    t = tier_order(tier)
    if t >= batch:
        return batch
    return batch - (batch - t) * span + min(span - 1, max(0, rank))


def expected_wait(ahead: int, slots: int, hold_s: float, before_rate: float = 0.0) -> float:
    """How long a request waits for a slot with `ahead` requests to be served before it,
    `slots` sequence slots each held `hold_s` on average, while requests of the classes
    that go before it arrive at `before_rate` a second: slots free at `slots / hold_s` a
    second, the classes before it take `before_rate` of that as they come, and its queue
    drains at the rest, so it waits for the (ahead + 1)-th of those (inf: nothing is left
    for it). Counting the running requests' holds whole overstates the wait by at most
    one hold; the arrivals before it are the last few seconds' rate, not a forecast."""
    left = max(1, slots) / max(hold_s, 1e-3) - before_rate
    return math.inf if left <= 0 else (ahead + 1) / left


def floor_wait(ahead: int, floor: int, hold_s: float, after_s: float) -> float:
    """The longest a request of a tier with a minimum share (`floor` slots: flex) waits
    however busy the engine: its tier's oldest request gets the floor back once it has
    waited `after_s`, and the floor serves its tier's `ahead` at `floor / hold_s` a second
    (inf: no floor)."""
    return math.inf if floor <= 0 else after_s + (ahead + 1) * max(hold_s, 1e-3) / floor


def shed(wait_s: float, bound_s: float) -> int | None:
    """Retry-After (whole seconds, 1 to `MAX_RETRY_S`) for a request whose expected wait
    passes its tier's bound: when the queue before it should have drained to the bound.
    None: it queues (no bound where `bound_s` is 0)."""
    if bound_s <= 0 or wait_s <= bound_s:
        return None
    return max(1, math.ceil(min(wait_s - bound_s, MAX_RETRY_S)))
