"""The quota ledger (table `ledger`, append-only): what is reserved, settled, refunded.

Rows, one per kind and subject (`idempotency_key` = `<kind>:<subject>`, so whoever
writes twice writes once; the first row stands):
- `reserve`: what a subject may take. `request:<id>` (tier priority/default/flex): its
  input estimate, corrected to the engine's prompt_tokens where known when written, and
  its max_tokens (absent: the rest of the context); written off the request path by the
  API's flusher, or by the journaling transaction below if that comes first.
  `batch:<id>` (tier batch): the batch's estimated tokens, at validation.
- `settle`: what it used, and it closes the reservation: what was reserved beyond it is
  released by the settle itself (`reserved_vs_settled` counts it as refunded), no row of
  its own. A request's, in the transaction that journals its outcome in a
  `request_finished` event (prompt_tokens, completion_tokens as that event records them):
  its key is what says the request is journaled, once;
  a batch item's (`item:<id>:<idx>`, its journal stream, no reserve of its own), in the transaction that
  journals its result (the usage in the response; 0/0 for a failed item).
- `refund`: all of a reservation that closes unsettled (a batch at its end, a request that
  never reached an engine). Journals written before migration 0026 also hold, after a
  request's settle, a refund of what its reservation held beyond it.
- `expire`: a reservation whose admitting process (`holder`) has not been seen for the
  TTL; written by the reconciler. A settle that lands later still counts.

So a request that ran writes two rows, whatever it used.

The fold of these rows into `quota_usage` is journal/fold.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import admission_holders, allowances_in_force, ledger, limits, quota_usage
from protocol import keys
from protocol.limits import ANY_MODEL, LIMITS, LimitSet

RESERVE, SETTLE, REFUND, EXPIRE = "reserve", "settle", "refund", "expire"
CLOSING = (SETTLE, REFUND, EXPIRE)
# How far back the fold and expiry look for reservations: a day window, and batches open
# for their 24 h completion window and a little more.
HORIZON_S = 2 * 86_400
# Interactive reservations settle within an hour of admission (a request's window, or
# the sweep of the engines' records, journals it), or expire with their holder: the
# synchronous mode counts those in flight within this.
INTERACTIVE_HORIZON_S = 2 * 3_600


def key(kind: str, subject: str) -> str:
    return f"{kind}:{subject}"


def timestamp(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)


@dataclass(frozen=True)
class Entry:
    kind: str
    subject: str
    tenant: str
    model: str
    tier: str
    input_tokens: int
    output_tokens: int
    holder: str | None = None
    at: datetime | None = None  # None: the writing transaction's time

    @property
    def key(self) -> str:
        return key(self.kind, self.subject)

    def closing(self, kind: str, input_tokens: int | None = None, output_tokens: int | None = None) -> Entry:
        """The same subject's `kind` row, for these tokens (default: all it reserved)."""
        return Entry(kind, self.subject, self.tenant, self.model, self.tier,
                     self.input_tokens if input_tokens is None else input_tokens,
                     self.output_tokens if output_tokens is None else output_tokens, self.holder)


_INSERT = text(
    """
    INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder, idempotency_key, at)
    SELECT tenant, model, tier, subject, kind, i, o, holder, key, coalesce(at, now())
      FROM unnest(CAST(:tenant AS text[]), CAST(:model AS text[]), CAST(:tier AS text[]), CAST(:subject AS text[]),
                  CAST(:kind AS text[]), CAST(:i AS bigint[]), CAST(:o AS bigint[]), CAST(:holder AS text[]),
                  CAST(:key AS text[]), CAST(:at AS timestamptz[]))
           WITH ORDINALITY AS n(tenant, model, tier, subject, kind, i, o, holder, key, at, ord)
     ORDER BY subject, ord
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
    """
)


async def insert(conn: AsyncConnection, entries: Sequence[Entry]) -> list[str]:
    """One multi-row INSERT in the caller's transaction; keys already in the ledger are
    skipped. Returns the keys written. Rows go in by subject, each subject's in the
    caller's order (a reservation before its refund): two writers of the same subjects'
    rows (the API's flusher and the journaling of a request, both writing its
    reservation) then take the unique index's locks in one order, and neither waits on
    the other while holding what the other waits for (a deadlock)."""
    if not entries:
        return []
    cols: dict[str, list[Any]] = dict(
        tenant=[e.tenant for e in entries], model=[e.model for e in entries], tier=[e.tier for e in entries],
        subject=[e.subject for e in entries], kind=[e.kind for e in entries],
        i=[e.input_tokens for e in entries], o=[e.output_tokens for e in entries],
        holder=[e.holder for e in entries], key=[e.key for e in entries], at=[e.at for e in entries],
    )
    return list((await conn.execute(_INSERT, cols)).scalars())


async def settle(conn: AsyncConnection, used: Entry, reservation: Entry | None = None) -> bool:
    return bool(await settle_all(conn, [(used, reservation)]))


async def settle_all(conn: AsyncConnection, settles: Sequence[tuple[Entry, Entry | None]]) -> set[str]:
    """In the caller's transaction (the one that journals the outcomes), for each (`used`,
    `reservation`): the reservation if nobody has written it yet, and the settle `used`
    unless the subject is settled already. Two statements however many subjects. The
    subjects this call settled (the others were settled before)."""
    assert all(used.kind == SETTLE for used, _ in settles)
    await insert(conn, [r for _, r in settles if r is not None])
    written = set(await insert(conn, [used for used, _ in settles]))
    return {used.subject for used, _ in settles if used.key in written}


_REFUND_OPEN = text(
    """
    INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder, idempotency_key, at)
    SELECT r.tenant, r.model, r.tier, r.subject, 'refund', r.input_tokens, r.output_tokens, r.holder,
           'refund:' || r.subject, now()
      FROM ledger r
     WHERE r.idempotency_key = 'reserve:' || CAST(:subject AS text)
       AND NOT EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('settle', 'refund', 'expire'))
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
    """
)


async def refund(conn: AsyncConnection, subject: str) -> bool:
    """Release all of `subject`'s reservation, if it has one still open (a batch at its
    end). Whether this call wrote the refund."""
    return (await conn.execute(_REFUND_OPEN, dict(subject=subject))).first() is not None


# -- batches ----------------------------------------------------------------------------

_OPEN_BATCHES = text(
    """
    SELECT r.model, sum(r.input_tokens + r.output_tokens) AS tokens
      FROM ledger r
     WHERE r.kind = 'reserve' AND r.tier = 'batch' AND r.tenant = :tenant
       AND r.at >= now() - make_interval(secs => :horizon)
       AND NOT EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('settle', 'refund', 'expire'))
     GROUP BY r.model
    """
)


async def lock_tenant(conn: AsyncConnection, tenant: str) -> None:
    """Serialise admission decisions for `tenant` until the transaction ends."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('ballast.admission:' || :t, 0))"),
                       dict(t=tenant))


async def open_batch_tokens(conn: AsyncConnection, tenant: str) -> dict[str, int]:
    """Tokens of the tenant's open batch reservations, by model."""
    rows = (await conn.execute(_OPEN_BATCHES, dict(tenant=tenant, horizon=HORIZON_S))).all()
    return {r.model: int(r.tokens) for r in rows}


_SETTLE_ITEMS = text(
    """
    INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder, idempotency_key, at)
    SELECT n.tenant, coalesce(bi.body->>'model', ''), 'batch', n.subject, 'settle',
           n.i, n.o, NULL, 'settle:' || n.subject, now()
      FROM unnest(CAST(:tenant AS text[]), CAST(:batch_id AS text[]), CAST(:idx AS int[]),
                  CAST(:subject AS text[]), CAST(:i AS bigint[]), CAST(:o AS bigint[]))
           WITH ORDINALITY AS n(tenant, batch_id, idx, subject, i, o, ord)
      LEFT JOIN batch_items bi ON bi.batch_id = n.batch_id AND bi.idx = n.idx
     ORDER BY n.ord
    ON CONFLICT (idempotency_key) DO NOTHING
    """
)


@dataclass(frozen=True)
class ItemUsage:
    tenant: str
    batch_id: str
    idx: int
    input_tokens: int
    output_tokens: int


async def settle_items(conn: AsyncConnection, items: Sequence[ItemUsage]) -> None:
    """Settle batch items (`item:<id>:<idx>`, no reserve of their own: the batch holds
    one for them all), in the caller's transaction: the one journaling their results."""
    if items:
        await conn.execute(_SETTLE_ITEMS, dict(
            tenant=[u.tenant for u in items], batch_id=[u.batch_id for u in items], idx=[u.idx for u in items],
            subject=[keys.item(u.batch_id, u.idx) for u in items],
            i=[u.input_tokens for u in items], o=[u.output_tokens for u in items]))


# -- limits -------------------------------------------------------------------------------


def limit_set(row: Any) -> LimitSet:
    m = row._mapping
    return LimitSet(m["model"], **{name: m[name] for name in LIMITS})


async def load_limits(conn: AsyncConnection, tenant: str | None = None) -> dict[str, tuple[LimitSet, ...]]:
    """Limits by tenant, each tenant's '*' first, then by model."""
    q = select(limits).order_by(limits.c.tenant, limits.c.model != ANY_MODEL, limits.c.model)
    if tenant is not None:
        q = q.where(limits.c.tenant == tenant)
    out: dict[str, list[LimitSet]] = {}
    for row in (await conn.execute(q)).all():
        out.setdefault(row.tenant, []).append(limit_set(row))
    # Where regions are cells, this cell's share of a global daily limit bounds the day too
    # (migration 0031): the lesser of the two applies.
    a = select(allowances_in_force.c.tenant, allowances_in_force.c.model, allowances_in_force.c.tokens_per_day)
    if tenant is not None:
        a = a.where(allowances_in_force.c.tenant == tenant)
    for row in (await conn.execute(a)).all():
        if row.tokens_per_day is None:
            continue
        sets = out.setdefault(row.tenant, [])
        i = next((i for i, s in enumerate(sets) if s.model == row.model), None)
        if i is None:
            sets.append(LimitSet(row.model, tokens_per_day=row.tokens_per_day))
            sets.sort(key=lambda s: (s.model != ANY_MODEL, s.model))
        elif sets[i].tokens_per_day is None or row.tokens_per_day < sets[i].tokens_per_day:
            sets[i] = replace(sets[i], tokens_per_day=row.tokens_per_day)
    return {t: tuple(sets) for t, sets in out.items()}


# -- usage ----------------------------------------------------------------------------------

def standing(where: str, seen: str = "true", name: str = "x") -> str:
    """CTEs `{name}_r` and `{name}`: the reservations (reserve rows) that `where` picks and
    how each stands (read by usage here and by journal/fold.py): open (reserved figures),
    settled (used figures), refunded or expired unsettled (0 tokens). Only the ledger rows
    `seen` (a condition on `l`) count, reserve rows and closing rows alike: the fold asks
    how a reservation stood when it last read the ledger."""
    return f"""
    {name}_r AS (
      SELECT subject, tenant, model, tier, coalesce(holder, '') AS holder, at, input_tokens AS ri,
             output_tokens AS ro
        FROM ledger l
       WHERE kind = 'reserve' AND ({where}) AND ({seen})
    ), {name} AS (
      SELECT r.subject, r.tenant, r.model, r.tier, r.holder, r.at, NOT c.closed AS open,
             r.tier <> 'batch' AS interactive,
             CASE WHEN c.settled THEN c.si WHEN c.closed THEN 0 ELSE r.ri END AS i,
             CASE WHEN c.settled THEN c.so WHEN c.closed THEN 0 ELSE r.ro END AS o,
             r.ri + r.ro AS held
        FROM {name}_r r CROSS JOIN LATERAL (  -- one index probe (ledger_subject) per reservation
          SELECT count(*) > 0 AS closed, coalesce(bool_or(l.kind = 'settle'), false) AS settled,
                 coalesce(sum(l.input_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS si,
                 coalesce(sum(l.output_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS so
            FROM ledger l
           WHERE l.subject = r.subject AND l.kind IN ('settle', 'refund', 'expire') AND ({seen})
        ) c
    )
"""


_USAGE = text(
    "WITH" + standing("tenant = :tenant AND at >= :since AND tier <> 'batch'") + """
    SELECT model,
           count(*) FILTER (WHERE at >= :minute) AS requests,
           coalesce(sum(i) FILTER (WHERE at >= :minute), 0) AS input_tokens,
           coalesce(sum(o) FILTER (WHERE at >= :minute), 0) AS output_tokens,
           coalesce(sum(i + o) FILTER (WHERE at >= :day), 0) AS day_tokens,
           count(*) FILTER (WHERE open) AS in_flight
      FROM x GROUP BY model
    """
)


@dataclass
class Counts:
    """Usage of one tenant × model (of one holder, or summed), for the windows starting at
    `minute` and `day` (unix seconds)."""

    minute: float = 0.0
    day: float = 0.0
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    day_tokens: int = 0
    in_flight: int = 0
    batch_queue_tokens: int = 0


async def usage(conn: AsyncConnection, tenant: str, minute: float, day: float, now: float, *,
                day_tokens: bool = True, in_flight: bool = True) -> dict[str, Counts]:
    """The tenant's interactive usage by model, exact, straight from the ledger (the
    synchronous admission mode's read). It reads the reservations of the minute, and of
    the day or the last hours only where `day_tokens` or `in_flight` are wanted (the
    figures not wanted are then partial)."""
    since = minute
    if day_tokens:
        since = min(since, day)
    if in_flight:
        since = min(since, now - INTERACTIVE_HORIZON_S)
    rows = (await conn.execute(_USAGE, dict(tenant=tenant, minute=timestamp(minute), day=timestamp(day),
                                            since=timestamp(since)))).all()
    return {r.model: Counts(minute, day, r.requests, r.input_tokens, r.output_tokens, r.day_tokens, r.in_flight)
            for r in rows}


async def trained_tokens(conn: AsyncConnection, tenant: str, since: float) -> dict[str, int]:
    """The tokens the tenant's fine-tuning settled since `since` (unix seconds), by model:
    training reserves nothing (a chunk's tokens are known once it has trained), so its
    settles stand alone, outside the reservations `usage` reads."""
    return (await trained_by_tenant(conn, since, tenant)).get(tenant, {})


def trained_query(since: float, tenant: str | None = None) -> Select:
    """(tenant, model, tokens) that fine-tuning settled since `since`."""
    q = (select(ledger.c.tenant, ledger.c.model, func.sum(ledger.c.input_tokens + ledger.c.output_tokens).label("n"))
         .where(ledger.c.tier == "training", ledger.c.kind == SETTLE, ledger.c.at >= timestamp(since))
         .group_by(ledger.c.tenant, ledger.c.model))
    return q if tenant is None else q.where(ledger.c.tenant == tenant)


async def trained_by_tenant(conn: AsyncConnection, since: float,
                            tenant: str | None = None) -> dict[str, dict[str, int]]:
    """As `trained_tokens`, for every tenant (or one): {tenant: {model: tokens}}."""
    out: dict[str, dict[str, int]] = {}
    for t, model, n in (await conn.execute(trained_query(since, tenant))).all():
        out.setdefault(t, {})[model] = int(n)
    return out


# -- what an admitting process reads and writes about itself ------------------------------------


async def seen(conn: AsyncConnection, holder: str) -> None:
    stmt = pg_insert(admission_holders).values(holder=holder)
    await conn.execute(stmt.on_conflict_do_update(index_elements=[admission_holders.c.holder],
                                                  set_=dict(seen_at=func.now())))


async def others(conn: AsyncConnection, holder: str) -> list[dict[str, Any]]:
    """The fold's rows of every holder but `holder`, for the windows it keeps current."""
    q = select(quota_usage).where(
        quota_usage.c.holder != holder,
        quota_usage.c.starts_at >= func.now() - text("interval '2 days'"),
    )
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


# -- settled usage by time bucket (the audit views' figures, in UTC) --------------------

BUCKETS = dict(minute="1 minute", hour="1 hour", day="1 day")


async def settled_buckets(conn: AsyncConnection, tenant: str | None, unit: str, start: float, end: float,
                          by: Sequence[str]) -> list[dict[str, Any]]:
    """Settled usage per `unit` bucket in [start, end) (Unix seconds), of one tenant or every
    one, grouped further by `by` (columns of the ledger: model, tier): what the audit views
    `usage_by_minute|hour|day` hold for those buckets, read straight off the ledger's index."""
    assert unit in BUCKETS and set(by) <= {"model", "tier"}, (unit, by)
    cols = "".join(f", {c}" for c in by)
    rows = await conn.execute(text(f"""
        SELECT extract(epoch FROM date_trunc('{unit}', at, 'UTC'))::bigint AS start{cols},
               count(*) AS requests, sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens
          FROM ledger
         WHERE kind = 'settle' AND at >= to_timestamp(:start) AND at < to_timestamp(:end)
           AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
         GROUP BY 1{cols} ORDER BY 1{cols}"""), dict(start=start, end=end, tenant=tenant))
    return [dict(r) for r in rows.mappings()]
