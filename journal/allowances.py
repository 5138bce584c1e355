"""A cell's allowances (migration 0031): its share of each tenant's global daily tokens,
as the cross-region reconciler sets them (ballast/cells.py), and what the reconciler reads
of the cell to set them and to weigh its traffic (its usage, its engines' capacity)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.ledger import timestamp, trained_query
from journal.schema import allowances_in_force, api_keys, engines, quota_usage, tenants
from protocol.limits import ANY_MODEL


@dataclass(frozen=True)
class Allowance:
    """One change of a cell's allowance for a tenant × model ('*': all its models)."""

    tenant: str
    model: str
    tokens_per_day: int | None  # None: lifted
    global_tokens_per_day: int | None
    used: int  # the cell's usage of the day it was computed from
    tick: str


def _in_force() -> Select:
    return select(allowances_in_force.c.tenant, allowances_in_force.c.model, allowances_in_force.c.tokens_per_day)


# The history rows and the allowances in force, in one statement: all of it or none, with
# no transaction to open and close over a link between regions.
_APPEND = text("""
    WITH h AS (
      INSERT INTO allowances (tenant, model, tokens_per_day, global_tokens_per_day, used, tick)
      SELECT * FROM unnest(CAST(:tenant AS text[]), CAST(:model AS text[]), CAST(:n AS bigint[]),
                           CAST(:global AS bigint[]), CAST(:used AS bigint[]), CAST(:tick AS text[]))
      RETURNING id, tenant, model, tokens_per_day, set_at)
    INSERT INTO allowances_in_force (tenant, model, tokens_per_day, id, set_at)
    SELECT tenant, model, tokens_per_day, id, set_at FROM h
    ON CONFLICT (tenant, model) DO UPDATE
      SET tokens_per_day = excluded.tokens_per_day, id = excluded.id, set_at = excluded.set_at""")


async def append(conn: AsyncConnection, rows: Sequence[Allowance]) -> None:
    if rows:
        await conn.execute(_APPEND, dict(
            tenant=[a.tenant for a in rows], model=[a.model for a in rows], n=[a.tokens_per_day for a in rows],
            **{"global": [a.global_tokens_per_day for a in rows]}, used=[a.used for a in rows],
            tick=[a.tick for a in rows]))


@dataclass(frozen=True)
class DayUsage:
    """A cell's tokens of one UTC day by (tenant, model), as its admission counts them
    against `tokens_per_day` (reserved and settled, and training's settles), and when its
    fold last ran (None: never)."""

    tokens: dict[tuple[str, str], int]
    folded_at: datetime | None

    def of(self, tenant: str, model: str) -> int:
        if model == ANY_MODEL:
            return sum(n for (t, _), n in self.tokens.items() if t == tenant)
        return self.tokens.get((tenant, model), 0)


@dataclass(frozen=True)
class CellView:
    """What the reconciler reads of a cell each tick, in one statement (one snapshot, one
    round trip: between regions a round trip is a tenth of a second or more)."""

    usage: DayUsage
    in_force: dict[tuple[str, str], int | None]
    capacity: tuple[int, int]  # its live, non-draining engines' slots, and those chat holds
    fenced: dict[str, tuple[str, ...]]  # the hash of each live key of a fenced tenant → its regions
    free: frozenset[str] = frozenset()  # the hash of each live key of a tenant fenced nowhere


def _rows(q: Select) -> Any:
    """`q`'s rows as one JSON array of arrays, for a column of a one-row SELECT."""
    sq = q.subquery()
    return select(func.coalesce(func.json_agg(func.json_build_array(*sq.c)), text("'[]'::json"))).scalar_subquery()


def _usage_query(day: float) -> Select:
    return (select(quota_usage.c.tenant, quota_usage.c.model,
                   func.sum(quota_usage.c.input_tokens + quota_usage.c.output_tokens).label("n"))
            .where(quota_usage.c.window == "day", quota_usage.c.starts_at == timestamp(day))
            .group_by(quota_usage.c.tenant, quota_usage.c.model))


def _capacity_query(within_s: float) -> Select:
    return select(engines.c.stats).where(
        engines.c.seen_at > func.now() - text(f"interval '{float(within_s)} seconds'"), engines.c.draining.is_(False))


def _keys_query() -> Select:
    return (select(api_keys.c.hash, tenants.c.regions).join(tenants, tenants.c.id == api_keys.c.tenant)
            .where(api_keys.c.revoked_at.is_(None)))


def _slots(stats: Sequence[dict[str, Any]]) -> tuple[int, int]:
    return sum(int(s.get("max_seqs", 1)) for s in stats), sum(int(s.get("interactive", 0)) for s in stats)


async def view(conn: AsyncConnection, day: float, within_s: float = 5.0) -> CellView:
    """The cell's usage of the UTC day starting at `day` (unix seconds), as its admission
    counts it against `tokens_per_day`: the fold's day rows of every admitting process
    (what each admitted as of the fold's last tick) and training's settles; the allowances
    in force; its capacity; its tenants' live keys (by hash), the fenced ones' with their regions."""
    row = (await conn.execute(select(
        _rows(_usage_query(day)), _rows(trained_query(day)), _rows(_in_force()),
        _rows(_capacity_query(within_s)), text("(SELECT max(folded_at) FROM quota_fold)"),
        _rows(_keys_query())))).one()
    tokens: dict[tuple[str, str], int] = {}
    for tenant, model, n in (*row[0], *row[1]):
        tokens[(tenant, model)] = tokens.get((tenant, model), 0) + int(n)
    return CellView(DayUsage(tokens, row[4]), {(t, m): a for t, m, a in row[2]}, _slots([s for (s,) in row[3]]),
                    {h: tuple(regions) for h, regions in row[5] if regions is not None},
                    frozenset(h for h, regions in row[5] if regions is None))


async def settled_by_day(conn: AsyncConnection, since: float, tenant: str | None = None) -> list[dict[str, Any]]:
    """The cell's audit view `usage_by_day` from the UTC day of `since` on: settled usage
    per tenant and day (its models and tiers summed), oldest first."""
    rows = await conn.execute(text("""
        SELECT tenant, extract(epoch FROM day)::bigint AS day, sum(requests)::bigint AS requests,
               sum(input_tokens)::bigint AS input_tokens, sum(output_tokens)::bigint AS output_tokens
          FROM usage_by_day
         WHERE day >= date_trunc('day', to_timestamp(:since)) AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
         GROUP BY tenant, day ORDER BY day, tenant"""), dict(since=since, tenant=tenant))
    return [dict(r) for r in rows.mappings()]
