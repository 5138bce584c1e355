"""Reserved capacity: a tenant's sequence slots on a model's pool, or output tokens a
second there (held as the slots that give them), kept from every other
tenant's interactive work and lent only to work that yields without loss (batch, which is
preempted with every token journaled). Pure.

A pool's reservation is spread over its live engine workers (`share`), or over those of
one region where it names one (`shares`); on each, the part
its tenant is not using is held back from the others' interactive requests (`held_back`),
so the tenant's next request finds a slot at once whatever the load. The engine's batch
work is lent them (EngineSlots.lend), even while other tenants' chats keep batch out of the
rest, and gives one up the moment the tenant's request takes it: its victim is aborted
within an engine step, every token it had journaled, or, where vLLM runs spare sequences,
left to end on its own beside the tenant's request (engine/slots.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace


def share(slots: int, engines: Iterable[str], me: str) -> int:
    """Engine `me`'s part of a pool reservation of `slots`: an even split over the pool's
    engines (ids in order), the remainder one each to the first."""
    order = sorted({*engines, me})
    base, extra = divmod(max(0, slots), len(order))
    return base + (order.index(me) < extra)


@dataclass(frozen=True)
class Reserved:
    """A reservation in force: `slots` of the pool for `tenant`, in `region` ("": anywhere);
    or `tokens_per_s` output tokens a second there, which `in_slots` turns into slots."""

    tenant: str
    slots: int
    region: str = ""
    tokens_per_s: int = 0


@dataclass(frozen=True)
class Peer:
    """A live engine worker of the pool, as it last announced itself."""

    region: str = ""
    seqs: int = 0  # its sequence slots
    rate: float = 0.0  # output tokens a second it generates at full load, all work (0: not measured)
    spare: int = 0  # sequences vLLM runs beyond its slots, which share that rate too


def slots_for(tokens_per_s: int, peers: Iterable[Peer]) -> int:
    """The slots that give `tokens_per_s` output tokens a second on `peers` even with every
    sequence busy. vLLM gives each running sequence a token a step, so a slot's rate at
    full load is the rate measured at full load over every sequence run meanwhile (spares
    included; a step with fewer running only raises each one's share), over the peers that
    have measured one: an engine not yet run full counts for slots, not for the rate. Where
    nothing is measured yet, one slot: a pool that has not run full has room for the
    tenant's requests anyway, and the first time it does, the rate is measured."""
    peers = list(peers)
    seqs = sum(p.seqs for p in peers)
    measured = [p for p in peers if p.rate > 0]  # an engine not yet run full says nothing of the rate
    if tokens_per_s <= 0 or seqs <= 0:
        return 0
    if not measured:
        return 1
    running, rate = sum(p.seqs + p.spare for p in measured), sum(p.rate for p in measured)
    return min(seqs, max(1, math.ceil(tokens_per_s * running / rate)))


def in_slots(pool: Iterable[Reserved], peers: Mapping[str, Peer]) -> list[Reserved]:
    """The pool's reservations in slots: one in tokens a second becomes the slots that give
    them on its region's engine workers (`peers`: live, not draining), or the pool's."""
    out = []
    for r in pool:
        if r.tokens_per_s:
            here = [p for p in peers.values() if not r.region or p.region == r.region]
            r = replace(r, slots=slots_for(r.tokens_per_s, here))
        out.append(r)
    return out


def shares(pool: Iterable[Reserved], engines: Mapping[str, str], me: str) -> dict[str, int]:
    """Tenant → engine `me`'s part of its reservations (none where that part is 0):
    `engines` are the pool's live engine ids → their regions, less those draining; a
    regional reservation is split over that region's engines alone. A draining `me` (not
    among them) holds none: its peers have split its part already."""
    if me not in engines:
        return {}
    out: dict[str, int] = {}
    for r in pool:
        if r.region and engines.get(me) != r.region:
            continue
        peers = [e for e, region in engines.items() if not r.region or region == r.region]
        if n := share(r.slots, peers, me):
            out[r.tenant] = out.get(r.tenant, 0) + n
    return out


def unused(reserved: Mapping[str, int], running_of: Mapping[str, int]) -> dict[str, int]:
    """Tenant → the slots of its reservation it is not using."""
    return {t: r - running_of.get(t, 0) for t, r in reserved.items() if r > running_of.get(t, 0)}


def used(reserved: Mapping[str, int], running_of: Mapping[str, int]) -> dict[str, int]:
    """Tenant → the slots of its reservation its requests hold."""
    return {t: min(r, running_of.get(t, 0)) for t, r in reserved.items()}


def held_back(reserved: Mapping[str, int], running_of: Mapping[str, int], tenant: str) -> int:
    """Slots `tenant`'s interactive requests may not take: the other reservations' unused parts."""
    return sum(n for t, n in unused(reserved, running_of).items() if t != tenant)


def within(reserved: Mapping[str, int], running_of: Mapping[str, int], tenant: str) -> bool:
    """`tenant`'s next request runs inside its reservation."""
    return running_of.get(tenant, 0) < reserved.get(tenant, 0)
