"""The control worker's gauges of what waits (journal/backlog.py) and the autoscaling signal
(policy/autoscale.py, from the engines' announcements), refreshed every `every_s` into
telemetry/families.py; a failed read is logged and tried again."""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from journal import backlog, engine_registry
from policy.autoscale import PoolLoad, ScalePolicy, engines_wanted
from protocol.engine_wire import EngineStats
from telemetry import families

log = logging.getLogger(__name__)


class Pace:
    """Each engine's batch tokens at the last two readings: the pool's tokens a second."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, int]] = {}  # engine → (when, its batch_tokens)

    def read(self, engines: list[dict], now: float) -> dict[str, float]:
        """Model → batch tokens a second over the engines read twice (an engine that
        restarted, its count lower, is read afresh)."""
        pace: dict[str, float] = {}
        seen = {}
        for e in engines:
            tokens = EngineStats.from_json(e["stats"]).batch_tokens
            seen[e["id"]] = (now, tokens)
            if (before := self.seen.get(e["id"])) is not None and tokens >= before[1] and now > before[0]:
                pace[e["model"]] = pace.get(e["model"], 0.0) + (tokens - before[1]) / (now - before[0])
        self.seen = seen
        return pace


async def refresh(db: AsyncEngine, policy: ScalePolicy = ScalePolicy(), pace: Pace | None = None,
                  stale_s: float = 5.0, now: float | None = None) -> None:
    async with db.connect() as conn:
        tenants = await backlog.batch_backlog(conn)
        tokens = await backlog.queued_tokens(conn)
        age = await backlog.fold_age_s(conn)
        surges = await backlog.surging(conn)
        quotas = await backlog.quota_use(conn)
        engines = await engine_registry.live(conn, stale_s)
    measured = (pace or Pace()).read(engines, time.monotonic() if now is None else now)
    pools: dict[str, list[EngineStats]] = {}
    for e in engines:
        pools.setdefault(e["model"], []).append(EngineStats.from_json(e["stats"]))
    # Cleared and set in one go (no await between): a scrape sees the whole of one reading.
    for gauge in (families.BACKLOG_ITEMS, families.BACKLOG_OLDEST, families.QUEUED_TOKENS, families.SURGING,
                  families.ENGINES, families.ENGINES_WANTED, families.QUOTA_USED, families.QUOTA_LIMIT):
        gauge.clear()
    items: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for t in tenants:
        label = families.tenant(t.tenant)
        items[label] = items.get(label, 0) + t.items
        oldest[label] = max(oldest.get(label, 0.0), t.oldest_s)
    for label in items:
        families.BACKLOG_ITEMS.labels(label).set(items[label])
        families.BACKLOG_OLDEST.labels(label).set(oldest[label])
    for q in quotas:  # tenants past the label bound: their uses and limits summed under "other"
        labels = families.tenant(q.tenant), q.model, q.limit
        families.QUOTA_USED.labels(*labels).inc(q.used)
        families.QUOTA_LIMIT.labels(*labels).inc(q.allowed)
    for model, n in tokens.items():
        families.QUEUED_TOKENS.labels(model).set(n)
    if age is not None:
        families.FOLD_AGE.set(age)
    for pool, on in surges.items():
        families.SURGING.labels(pool).set(1 if on else 0)
    for model in sorted(set(pools) | set(tokens)):
        stats = pools.get(model, [])
        load = PoolLoad(engines=len(stats), slots=max((s.max_seqs for s in stats), default=1),
                        interactive=sum(s.interactive for s in stats), queued_tokens=tokens.get(model, 0),
                        tokens_per_s=measured.get(model))
        for region in sorted({s.region for s in stats}):
            families.ENGINES.labels(model, region).set(sum(s.region == region for s in stats))
        families.ENGINES_WANTED.labels(model).set(engines_wanted(load, policy))


async def keep_refreshing(db: AsyncEngine, every_s: float, policy: ScalePolicy = ScalePolicy(),
                          stale_s: float = 5.0) -> None:
    pace = Pace()
    while True:
        try:
            await refresh(db, policy, pace, stale_s)
        except Exception as err:  # the database is away: the gauges keep their last reading
            log.warning("could not read the backlog for the metrics: %s", err)
        await asyncio.sleep(every_s)
