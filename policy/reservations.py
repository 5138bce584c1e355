"""Reserved capacity: a tenant's sequence slots on a model's pool, kept from every other
tenant's interactive work and lent only to work that yields without loss (batch, which is
preempted with every token journaled). Pure.

A pool's reservation is spread over its live engine workers (`share`); on each, the part
its tenant is not using is held back from the others' interactive requests (`held_back`),
so the tenant's next request finds a slot at once whatever the load. The engine's batch
work is lent them (EngineSlots.lend), even while other tenants' chats keep batch out of the
rest, and gives one up the moment the tenant's request takes it: its victim is aborted
within an engine step, every token it had journaled (engine/slots.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def share(slots: int, engines: Iterable[str], me: str) -> int:
    """Engine `me`'s part of a pool reservation of `slots`: an even split over the pool's
    engines (ids in order), the remainder one each to the first."""
    order = sorted({*engines, me})
    base, extra = divmod(max(0, slots), len(order))
    return base + (order.index(me) < extra)


def shares(pool: Mapping[str, int], engines: Iterable[str], me: str) -> dict[str, int]:
    """Tenant → engine `me`'s part of its reservation (none where that part is 0)."""
    engines = list(engines)
    return {t: n for t, s in pool.items() if (n := share(s, engines, me))}


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
