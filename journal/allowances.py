"""A cell's allowances (migration 0031): its share of each tenant's global daily tokens,
as the cross-region reconciler sets them (ballast/cells.py), and what the reconciler reads
of the cell to set them and to weigh its traffic (its usage, its engines' capacity)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.ledger import timestamp, trained_by_tenant
from journal.schema import allowances, engines, quota_usage
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


async def in_force(conn: AsyncConnection) -> dict[tuple[str, str], int | None]:
    """(tenant, model) → the allowance in force (None: lifted)."""
    q = (select(allowances.c.tenant, allowances.c.model, allowances.c.tokens_per_day)
         .distinct(allowances.c.tenant, allowances.c.model)
         .order_by(allowances.c.tenant, allowances.c.model, allowances.c.id.desc()))
    return {(r.tenant, r.model): r.tokens_per_day for r in (await conn.execute(q)).all()}


async def append(conn: AsyncConnection, rows: Sequence[Allowance]) -> None:
    if rows:
        await conn.execute(allowances.insert(), [
            dict(tenant=a.tenant, model=a.model, tokens_per_day=a.tokens_per_day,
                 global_tokens_per_day=a.global_tokens_per_day, used=a.used, tick=a.tick) for a in rows])


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


async def day_usage(conn: AsyncConnection, day: float) -> DayUsage:
    """The cell's usage of the UTC day starting at `day` (unix seconds): the fold's day
    rows of every admitting process, which count what it admitted as of its last tick."""
    q = (select(quota_usage.c.tenant, quota_usage.c.model,
                func.sum(quota_usage.c.input_tokens + quota_usage.c.output_tokens).label("n"))
         .where(quota_usage.c.window == "day", quota_usage.c.starts_at == timestamp(day))
         .group_by(quota_usage.c.tenant, quota_usage.c.model))
    rows = (await conn.execute(q)).all()
    tokens = {(r.tenant, r.model): int(r.n) for r in rows}
    for tenant, by_model in (await trained_by_tenant(conn, day)).items():
        for model, n in by_model.items():
            tokens[(tenant, model)] = tokens.get((tenant, model), 0) + n
    folded_at = (await conn.execute(text("SELECT max(folded_at) FROM quota_fold"))).scalar()
    return DayUsage(tokens, folded_at)


async def capacity(conn: AsyncConnection, within_s: float = 5.0) -> tuple[int, int]:
    """The cell's sequence slots over its live, non-draining engines, and how many of them
    chat holds (as each engine last announced)."""
    q = select(engines.c.stats).where(engines.c.seen_at > func.now() - text(f"interval '{float(within_s)} seconds'"),
                                      engines.c.draining.is_(False))
    stats = [r.stats for r in (await conn.execute(q)).all()]
    return sum(int(s.get("max_seqs", 1)) for s in stats), sum(int(s.get("interactive", 0)) for s in stats)


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
