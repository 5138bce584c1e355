"""A tenant's global daily limit split into regional allowances, one per cell. Pure.

Each region is a cell with its own journal; its API admits against its own allowance from
local state, so a cell keeps serving when every other is out of reach. A reconciler reads
each cell's usage of the day on a timer and splits what is left of the global limit by
each cell's recent demand (`split`).

The split keeps Σ allowances = the limit (as far as the reconciler knows), whatever it can
reach:

1. A cell out of reach keeps the allowance it holds, counted as spent: nobody can tell how
   much of it it has used, and it may be serving with all of it.
2. What is free is the limit less what the reachable cells have used and the unreachable
   ones hold; nothing when they are past it already.
3. Each reachable cell gets its usage plus a part of what is free: `even` of it split
   evenly, so a cell whose demand has not shown yet can admit (and while much is free,
   nobody is held to what one tick happened to see), the rest by each cell's demand (the
   caller smooths it over ticks); parts are whole tokens, remainders to the largest
   fractions, ties by cell name. A cell's demand is what it admitted, so a cell held at its
   allowance (within `capped` of the limit) shows only what it was let admit: its demand is
   taken to be the busiest cell's, or it would never get more than its even part.

A cell whose allowance goes down must stop admitting before another's goes up, or both may
admit against the same tokens: `lowered` names them, and the reconciler writes those
first, waits for the cells to read them, then writes the rest. What a cell admits after
the reconciler read it and before it reads its lowered allowance is the one way past the
limit besides the cell's own (see `overshoot_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CellDay:
    """What the reconciler knows of one cell for one tenant × model this tick."""

    cell: str
    reachable: bool
    used: int = 0  # tokens of the UTC day counted against the limit there (0: unknown when unreachable)
    rate: float = 0.0  # its demand: tokens a second it admitted, smoothed over the last ticks
    allowance: int | None = None  # what the cell holds now (None: never given one)


def split(limit: int, cells: Sequence[CellDay], *, even: float = 0.2, capped: float = 0.01) -> dict[str, int]:
    """Cell → its allowance (steps 1–3 of the module doc). An unreachable cell keeps its
    own; one that never had an allowance is counted as holding nothing (see the docs: the
    bound starts once every cell has been given one)."""
    reachable = sorted((c for c in cells if c.reachable), key=lambda c: c.cell)
    held = sum(c.allowance or 0 for c in cells if not c.reachable)  # 1.
    out = {c.cell: c.allowance or 0 for c in cells if not c.reachable}
    if not reachable:
        return out
    free = max(0, limit - held - sum(c.used for c in reachable))  # 2.
    demand = [max(0.0, c.rate) for c in reachable]  # 3.
    busiest = max(demand)
    for i, c in enumerate(reachable):
        if c.allowance is not None and c.allowance - c.used <= capped * limit:
            demand[i] = max(demand[i], busiest)
    total = sum(demand)
    each = 1 / len(reachable)
    weights = [even * each + (1 - even) * (d / total if total > 0 else each) for d in demand]
    exact = [free * w for w in weights]
    parts = [math.floor(x) for x in exact]
    by_fraction = sorted(range(len(reachable)), key=lambda i: (-(exact[i] - parts[i]), reachable[i].cell))
    for i in by_fraction[:free - sum(parts)]:
        parts[i] += 1
    out.update({c.cell: c.used + p for c, p in zip(reachable, parts, strict=True)})
    return out


def lowered(before: Mapping[str, int | None], after: Mapping[str, int]) -> set[str]:
    """The cells whose allowance goes down (a cell with none before had no bound: any is lower)."""
    return {c for c, a in after.items() if (b := before.get(c)) is None or a < b}


def overshoot_bound(lowered_by: Sequence[tuple[int, float]], lag_s: float, in_cell: int = 0) -> int:
    """The most a tenant's usage of the day can pass its global limit by, from one tick:
    each lowered cell, (tokens it could still admit under its old allowance when it was
    read, its demand in tokens a second), admits at most the lesser of the two for `lag_s`
    (from its usage being read to its API processes reading the lower allowance: the
    cell's fold period + the reconciler's read-to-commit time + the cell's limit refresh);
    plus `in_cell`, what the cells' own admission may pass their allowances by (several API
    processes in one cell: policy.admission.overshoot_bound). Past usage is read again the
    next tick, so a tick's overshoot is taken from what the next tick shares out."""
    return sum(min(max(0, room), math.ceil(max(0.0, rate) * lag_s)) for room, rate in lowered_by) + in_cell
