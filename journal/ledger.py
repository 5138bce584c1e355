"""The quota ledger (table `ledger`, append-only) and its fold into `quota_usage`.

Rows, one per kind and subject (`idempotency_key` = `<kind>:<subject>`, so whoever
writes twice writes once; the first row stands):
- `reserve`: what a subject may take. `request:<id>` (tier priority/default/flex): its
  input estimate, corrected to the engine's prompt_tokens where known when written, and
  its max_tokens (absent: the rest of the context); written off the request path by the
  API's flusher, or by the journaling transaction below if that comes first.
  `batch:<id>` (tier batch): the batch's estimated tokens, at validation.
- `settle`: what it used. A request's, in the transaction that journals its
  `request_finished` event (prompt_tokens, completion_tokens as that event records them);
  a batch item's (`item:<id>:<idx>`, its journal stream, no reserve of its own), in the transaction that
  journals its result (the usage in the response; 0/0 for a failed item).
- `refund`: what a reservation held beyond what settled (a request), or all of it (a
  batch at its end, a request that never reached an engine).
- `expire`: a reservation whose admitting process (`holder`) has not been seen for the
  TTL; written by the reconciler. A settle that lands later still counts.

The fold (`fold`, the reconciler's every tick) attributes each reservation to the window
of its reserve row's `at` (fixed UTC minute and day windows) and counts it as reserved
while open, as settled once settled, as 0 tokens once refunded or expired unsettled; a
request counts once in `requests` whatever became of it. `in_flight` is the open
interactive reservations, `batch_queue_tokens` the open batch reservations. It reads only
what the ledger gained since the last tick (see "the reconciler" below).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.schema import admission_holders, limits, quota_usage
from policy.admission import ANY_MODEL, LimitSet
from protocol import keys

RESERVE, SETTLE, REFUND, EXPIRE = "reserve", "settle", "refund", "expire"
CLOSING = (SETTLE, REFUND, EXPIRE)
# How far back the fold and expiry look for reservations: a day window, and batches open
# for their 24 h completion window and a little more.
HORIZON_S = 2 * 86_400
# Interactive reservations settle within an hour of admission (the request's workflow
# journals an abandoned one after ABANDON_AFTER), or expire with their holder: the
# synchronous mode counts those in flight within this.
INTERACTIVE_HORIZON_S = 2 * 3_600
_FOLD_LOCK = 0x0BA11A57  # pg_advisory_xact_lock key: one fold at a time








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
     ORDER BY ord
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
    """
)


async def insert(conn: AsyncConnection, entries: Sequence[Entry]) -> list[str]:
    """One multi-row INSERT in the caller's transaction, in order; keys already in the
    ledger are skipped. Returns the keys written."""
    if not entries:
        return []
    cols: dict[str, list[Any]] = dict(
        tenant=[e.tenant for e in entries], model=[e.model for e in entries], tier=[e.tier for e in entries],
        subject=[e.subject for e in entries], kind=[e.kind for e in entries],
        i=[e.input_tokens for e in entries], o=[e.output_tokens for e in entries],
        holder=[e.holder for e in entries], key=[e.key for e in entries], at=[e.at for e in entries],
    )
    return list((await conn.execute(_INSERT, cols)).scalars())


async def reserved(conn: AsyncConnection, subject: str) -> Entry | None:
    row = (await conn.execute(
        text("SELECT tenant, model, tier, input_tokens, output_tokens, holder, at FROM ledger "
             "WHERE idempotency_key = :k"), dict(k=key(RESERVE, subject)))).first()
    if row is None:
        return None
    return Entry(RESERVE, subject, row.tenant, row.model, row.tier, row.input_tokens, row.output_tokens, row.holder,
                 row.at)


async def settle(conn: AsyncConnection, used: Entry, reservation: Entry | None = None) -> None:
    """In the caller's transaction (the one that journals the outcome): the reservation
    if nobody has written it yet, the settle `used`, and the refund of what the
    reservation in the ledger held beyond it, dimension by dimension."""
    assert used.kind == SETTLE
    if reservation is not None:
        await insert(conn, [reservation])
    rows = [used]
    held = await reserved(conn, used.subject)
    if held is not None:
        back_in = max(0, held.input_tokens - used.input_tokens)
        back_out = max(0, held.output_tokens - used.output_tokens)
        if back_in or back_out:
            rows.append(used.closing(REFUND, back_in, back_out))
    await insert(conn, rows)


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
    return LimitSet(m["model"], m["requests_per_min"], m["input_tokens_per_min"], m["output_tokens_per_min"],
                    m["concurrent_requests"], m["tokens_per_day"], m["batch_queue_tokens"],
                    m["concurrent_fine_tunes"])


async def load_limits(conn: AsyncConnection, tenant: str | None = None) -> dict[str, tuple[LimitSet, ...]]:
    """Limits by tenant, each tenant's '*' first, then by model."""
    q = select(limits).order_by(limits.c.tenant, limits.c.model != ANY_MODEL, limits.c.model)
    if tenant is not None:
        q = q.where(limits.c.tenant == tenant)
    out: dict[str, list[LimitSet]] = {}
    for row in (await conn.execute(q)).all():
        out.setdefault(row.tenant, []).append(limit_set(row))
    return {t: tuple(sets) for t, sets in out.items()}


# -- usage ----------------------------------------------------------------------------------

# Reservations in the horizon and how each stands: open (reserved figures), settled (used
# figures), refunded or expired unsettled (0 tokens). `{where}` narrows the reservations.
_STANDING = """
    r AS (
      SELECT position, subject, tenant, model, tier, coalesce(holder, '') AS holder, holder AS holder_or_null, at,
             input_tokens AS ri, output_tokens AS ro
        FROM ledger
       WHERE kind = 'reserve' AND {where}
    ), x AS (
      SELECT r.position, r.subject, r.tenant, r.model, r.tier, r.holder, r.holder_or_null, r.at, NOT c.closed AS open,
             r.tier <> 'batch' AS interactive,
             CASE WHEN c.settled THEN c.si WHEN c.closed THEN 0 ELSE r.ri END AS i,
             CASE WHEN c.settled THEN c.so WHEN c.closed THEN 0 ELSE r.ro END AS o,
             r.ri + r.ro AS held
        FROM r CROSS JOIN LATERAL (  -- one index probe (ledger_subject) per reservation
          SELECT count(*) > 0 AS closed, coalesce(bool_or(l.kind = 'settle'), false) AS settled,
                 coalesce(sum(l.input_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS si,
                 coalesce(sum(l.output_tokens) FILTER (WHERE l.kind = 'settle'), 0) AS so
            FROM ledger l
           WHERE l.subject = r.subject AND l.kind IN ('settle', 'refund', 'expire')
        ) c
    )
"""

_USAGE = text(
    "WITH" + _STANDING.format(where="tenant = :tenant AND at >= :since AND tier <> 'batch'") + """
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


# -- the reconciler: expire, fold -------------------------------------------------------------
#
# The fold is incremental: a tick reads the ledger rows written since the last tick, not
# the day's or the horizon's, and gives the same `quota_usage` rows as recomputing the
# windows from the whole horizon would. What it keeps (migration 0006):
# - `quota_fold`: the snapshot the last tick read under. A ledger row is new to the fold
#   when that snapshot did not see its transaction as ended: `txid` (the writer's
#   transaction id, the column's default) ≥ the snapshot's xmax, or among its in-progress
#   ids. Neither positions nor times would do: a bigserial is drawn at INSERT and commits
#   whenever its transaction does, and a reserve row's `at` is the admitting process's
#   clock at admission, written a flush or two later (much later after Postgres was
#   unreachable). So no slack to guess: a transaction that had not ended when the
#   snapshot was taken is read again, every tick until one sees it ended, however long it
#   runs; one that had ended is visible to the tick's reads, which come after. The tick's
#   own transaction id is added to the in-progress ones, so what its caller writes after
#   the fold, in the same transaction, is read by the next tick. (A transaction left open
#   for long only makes the ticks re-read its own rows, not everything since it began.)
# - `quota_reservations`: each reservation from the floor on (the earlier of the day's
#   start and the previous minute's) as it counted at the tick that last read a row of
#   its subject; `quota_buckets`: their sums per tenant × model × holder × minute and day,
#   for the current and later windows.
# - `quota_open`: each open reservation of the horizon, and what it holds; `quota_open_sums`:
#   their sums per tenant × model × holder (in_flight, batch_queue_tokens).
# A tick takes the subjects with new rows, deletes their reservations from both tables and
# inserts them as they stand now, in one statement (one snapshot), adding the differences
# to the sums. Then `quota_usage`: minute rows from the minute buckets, day rows from the
# day buckets and the open sums. Expiry's candidates are the open reservations of holders
# not seen (from the sums, then `quota_open` by holder) and the reservations written
# since the last tick. So a tick costs the rows written since the last one, what leaves
# the horizon, the dead holders' open reservations, and the (tenant, model, holder)
# groups it writes; not the day's or the horizon's rows. Without a `quota_fold` row (the
# first tick after migration 0006) it builds the tables from the horizon, once.
#
# Windows and the horizon move with the clock, not with the ledger: each tick takes out
# of quota_open (and its sums) what has left the horizon, deletes the buckets of windows
# that have ended, and deletes reservations that can no longer count (after midnight, the
# day before's, a minute of them a tick: they count nowhere meanwhile); differences for
# ended windows are dropped. quota_usage keeps its rows and prune rules (minutes for an
# hour, days for a week), and admission reads it as before. The minute sums are kept for
# the current minutes only, not the whole day: a day's total is a bucket of its own, kept
# by the same differences.

# The last tick's snapshot (as text: xid8 has no client type) and clock.
_LAST = text("SELECT CAST(below AS text) AS below, CAST(in_progress AS text[]) AS in_progress, folded_at "
             "FROM quota_fold")

# Rows of ledger `{t}` the last tick may not have read; `:below`, `:in_progress` its snapshot.
_NEW_ROWS = "({t}.txid >= CAST(:below AS xid8) OR {t}.txid = ANY(CAST(:in_progress AS xid8[])))"
# The clock the fold takes its windows at: `:now`, or the transaction's; never before the
# last tick's (`:last`), as a transaction that began before the last tick ended may be
# next: it finds the windows as the last tick left them, pruned of what had ended.
_NOW = "greatest(coalesce(CAST(:now AS timestamptz), now()), CAST(:last AS timestamptz))"
_MINUTE = f"date_trunc('minute', {_NOW}, 'UTC')"
_DAY = f"date_trunc('day', {_NOW}, 'UTC')"
_FLOOR = f"least({_DAY}, {_MINUTE} - interval '1 minute')"
_HORIZON = f"{_NOW} - make_interval(secs => :horizon)"

# This statement's snapshot: its xmax, and the ids in progress under it with this
# transaction's own, if it has one yet (one drawn later is above xmax); and the clock.
_SNAPSHOT = f"""
    SELECT pg_snapshot_xmax(snap), ARRAY(SELECT pg_snapshot_xip(snap) UNION ALL
                                         SELECT pg_current_xact_id_if_assigned()
                                          WHERE pg_current_xact_id_if_assigned() IS NOT NULL), {_NOW}
      FROM pg_current_snapshot() AS snap
"""
_STATE = text("UPDATE quota_fold SET (below, in_progress, folded_at) = (" + _SNAPSHOT + ")")
_STATE_FIRST = text("INSERT INTO quota_fold (below, in_progress, folded_at)" + _SNAPSHOT)

# From the standing `x` (_STANDING) of some reservations: into quota_reservations those
# from the floor on, into quota_open the open ones (each returning them, sign 1).
_PUT = f"""
    put AS (
      INSERT INTO quota_reservations (position, subject, tenant, model, holder, at, interactive, input_tokens,
                                      output_tokens)
      SELECT position, subject, tenant, model, holder, at, interactive, i, o FROM x WHERE at >= {_FLOOR}
      RETURNING tenant, model, holder, at, interactive, input_tokens, output_tokens, 1 AS sign
    ), opened AS (
      INSERT INTO quota_open (position, subject, tenant, model, holder, at, interactive, held)
      SELECT position, subject, tenant, model, holder_or_null, at, interactive, held
        FROM x WHERE open AND at >= {_HORIZON}
      RETURNING tenant, model, coalesce(holder, '') AS holder, interactive, held, 1 AS sign
    )
"""

# Sums of `{rows}` (tenant, model, holder ('' for none), interactive, held, sign) into
# quota_open_sums.
_OPEN_SUMS = """
    INSERT INTO quota_open_sums AS s (tenant, model, holder, reservations, in_flight, batch_queue_tokens)
    SELECT d.tenant, d.model, d.holder, sum(d.sign), coalesce(sum(d.sign) FILTER (WHERE d.interactive), 0),
           coalesce(sum(d.sign * d.held) FILTER (WHERE NOT d.interactive), 0)
      FROM ({rows}) d
     GROUP BY 1, 2, 3
    ON CONFLICT (tenant, model, holder) DO UPDATE
       SET reservations = s.reservations + excluded.reservations, in_flight = s.in_flight + excluded.in_flight,
           batch_queue_tokens = s.batch_queue_tokens + excluded.batch_queue_tokens
"""

# Sums per window of `{rows}` (tenant, model, holder, at, interactive, input_tokens,
# output_tokens, sign), for the windows kept: the previous minute on, the day on.
_BUCKETS = f"""
    INSERT INTO quota_buckets AS b (tenant, model, holder, "window", starts_at, reservations, requests,
                                    input_tokens, output_tokens)
    SELECT d.tenant, d.model, d.holder, w.name, w.starts_at, sum(d.sign),
           coalesce(sum(d.sign) FILTER (WHERE d.interactive), 0),
           coalesce(sum(d.sign * d.input_tokens) FILTER (WHERE d.interactive), 0),
           coalesce(sum(d.sign * d.output_tokens) FILTER (WHERE d.interactive), 0)
      FROM ({{rows}}) d
     CROSS JOIN LATERAL (VALUES ('minute', date_trunc('minute', d.at, 'UTC')),
                                ('day', date_trunc('day', d.at, 'UTC'))) w(name, starts_at)
     WHERE (w.name = 'minute' AND w.starts_at >= {_MINUTE} - interval '1 minute')
        OR (w.name = 'day' AND w.starts_at >= {_DAY})
     GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (tenant, model, holder, "window", starts_at) DO UPDATE
       SET reservations = b.reservations + excluded.reservations, requests = b.requests + excluded.requests,
           input_tokens = b.input_tokens + excluded.input_tokens,
           output_tokens = b.output_tokens + excluded.output_tokens
"""

# Planner-proof (the fold's tables change faster than their statistics): an index probe
# per subject, as for an array of them.
_DIRTY = "{t}.subject = ANY(ARRAY(SELECT subject FROM dirty))"

# One statement, one snapshot: what a subject counted comes out of the buckets (sign −1)
# as what it counts now goes in. The tables have no unique key, as sibling CTEs do not see
# each other's rows: `gone` deletes only what was there before.
_TICK = text(
    "WITH dirty AS (SELECT DISTINCT subject FROM ledger WHERE " + _NEW_ROWS.format(t="ledger") + "),"
    + _STANDING.format(where=_DIRTY.format(t="ledger")) + f""",
    gone AS (
      DELETE FROM quota_reservations q WHERE {_DIRTY.format(t="q")}
      RETURNING q.tenant, q.model, q.holder, q.at, q.interactive, q.input_tokens, q.output_tokens, -1 AS sign
    ), closed AS (
      DELETE FROM quota_open q WHERE {_DIRTY.format(t="q")}
      RETURNING q.tenant, q.model, coalesce(q.holder, '') AS holder, q.interactive, q.held, -1 AS sign
    ),""" + _PUT + ", sums AS (" + _OPEN_SUMS.format(rows="SELECT * FROM closed UNION ALL SELECT * FROM opened") + ")"
    + _BUCKETS.format(rows="SELECT * FROM gone UNION ALL SELECT * FROM put")
)

# Open reservations that leave the horizon (they count nowhere any more), before the tick.
_AGE = text(
    f"""
    WITH aged AS (
      DELETE FROM quota_open WHERE at < {_HORIZON}
      RETURNING tenant, model, coalesce(holder, '') AS holder, interactive, held, -1 AS sign
    )"""
    + _OPEN_SUMS.format(rows="SELECT * FROM aged")
)

_REBUILD = (
    text("DELETE FROM quota_reservations"),
    text("DELETE FROM quota_open"),
    text("DELETE FROM quota_open_sums"),
    text("DELETE FROM quota_buckets"),
    text("WITH" + _STANDING.format(where=f"at >= {_HORIZON}") + "," + _PUT
         + ", sums AS (" + _OPEN_SUMS.format(rows="SELECT * FROM opened") + ")"
         + _BUCKETS.format(rows="SELECT * FROM put")),
)

_PRUNE = text(
    f"""
    WITH buckets AS (
      DELETE FROM quota_buckets
       WHERE ("window" = 'minute' AND starts_at < {_MINUTE} - interval '1 minute')
          OR ("window" = 'day' AND starts_at < {_DAY})
    )
    DELETE FROM quota_open_sums WHERE reservations = 0
    """
)

# Reservations that can no longer count (below the floor: after midnight, the day
# before's) go a minute of them a tick, oldest first: `:since` is the oldest's `at`.
_OLDEST = text(f"SELECT min(at) AS since, min(at) < {_FLOOR} AS behind FROM quota_reservations")
_PRUNE_RESERVATIONS = text(
    f"""
    DELETE FROM quota_reservations
     WHERE at >= :since AND at < least({_FLOOR}, CAST(:since AS timestamptz) + interval '1 minute')
    """
)

_FOLD_DELETE = text(
    f"""
    DELETE FROM quota_usage
     WHERE ("window" = 'minute' AND (starts_at >= {_MINUTE} - interval '1 minute'
                                   OR starts_at < {_NOW} - interval '1 hour'))
        OR ("window" = 'day' AND (starts_at >= {_DAY} OR starts_at < {_NOW} - interval '7 days'))
    """
)

# The current and previous minute (and later ones: a clock ahead) from their buckets; the
# day from its bucket (and later days'), with the sums of the horizon's open reservations.
_FOLD_INSERT = text(
    f"""
    INSERT INTO quota_usage (tenant, model, "window", starts_at, holder, requests, input_tokens, output_tokens,
                             in_flight, batch_queue_tokens, folded_at)
    SELECT tenant, model, 'minute', starts_at, holder, requests, input_tokens, output_tokens, 0, 0, {_NOW}
      FROM quota_buckets
     WHERE "window" = 'minute' AND starts_at >= {_MINUTE} - interval '1 minute'
       AND requests > 0
    UNION ALL
    SELECT tenant, model, 'day', {_DAY}, holder, coalesce(d.requests, 0),
           coalesce(d.input_tokens, 0), coalesce(d.output_tokens, 0), coalesce(o.in_flight, 0),
           coalesce(o.batch_queue_tokens, 0), {_NOW}
      FROM (SELECT tenant, model, holder, sum(reservations) AS reservations, sum(requests) AS requests,
                   sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens
              FROM quota_buckets
             WHERE "window" = 'day' AND starts_at >= {_DAY}
             GROUP BY tenant, model, holder) d
      FULL JOIN (SELECT * FROM quota_open_sums WHERE reservations > 0) o USING (tenant, model, holder)
     WHERE d.reservations > 0 OR o.reservations > 0
    """
)

_DEAD = "({h}.seen_at IS NULL OR {h}.seen_at < now() - make_interval(secs => :ttl))"
_EXPIRE_ROWS = f"""
    INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder, idempotency_key, at)
    SELECT r.tenant, r.model, r.tier, r.subject, 'expire', r.input_tokens, r.output_tokens, r.holder,
           'expire:' || r.subject, now()
      FROM ledger r
      LEFT JOIN admission_holders h ON h.holder = r.holder
     WHERE r.kind = 'reserve' AND r.holder IS NOT NULL AND r.at >= now() - make_interval(secs => :horizon)
       AND {_DEAD.format(h="h")}
       AND NOT EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('settle', 'refund', 'expire'))
       AND {{among}}
     ORDER BY r.position
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING subject
"""
# Before the fold has kept anything: among every reservation of the horizon.
_EXPIRE = text(_EXPIRE_ROWS.format(among="true"))
# Then among those open as the last tick left them and those written since: every
# reservation open now is one or the other. Of dead holders' (as a rule none), by position.
_EXPIRE_SINCE = text(
    f"""
    WITH dead AS MATERIALIZED (
      SELECT DISTINCT s.holder FROM quota_open_sums s LEFT JOIN admission_holders h ON h.holder = s.holder
       WHERE s.reservations > 0 AND {_DEAD.format(h="h")}
    ), candidates AS MATERIALIZED (
      SELECT q.position FROM quota_open q WHERE q.holder = ANY(ARRAY(SELECT holder FROM dead))
      UNION
      SELECT l.position FROM ledger l LEFT JOIN admission_holders h ON h.holder = l.holder
       WHERE l.kind = 'reserve' AND {_NEW_ROWS.format(t="l")} AND {_DEAD.format(h="h")}
    )"""
    + _EXPIRE_ROWS.format(among="r.position = ANY(ARRAY(SELECT position FROM candidates))")
)


async def _enter(conn: AsyncConnection) -> str:
    """Take the fold's lock (what it keeps is read in later statements: their snapshots
    come after the lock), and turn JIT off until `_leave`: the reconciler's are short
    statements over few rows, where compiling (hundreds of ms) never pays, and estimates
    on its small, fast-changing tables can pass the threshold. The JIT setting it was."""
    return str((await conn.execute(text(
        "SELECT current_setting('jit'), set_config('jit', 'off', true), pg_advisory_xact_lock(:k)"),
        dict(k=_FOLD_LOCK))).one()[0])


async def _leave(conn: AsyncConnection, was: str) -> None:
    await conn.execute(text("SELECT set_config('jit', :was, true)"), dict(was=was))


async def expire(conn: AsyncConnection, holder_ttl_s: float) -> list[str]:
    """Expire the open reservations of every holder not seen for `holder_ttl_s` (or never
    seen); forget holders not seen for a day. The subjects expired."""
    jit = await _enter(conn)  # what the fold keeps stays as it is meanwhile
    last = (await conn.execute(_LAST)).first()
    args: dict[str, Any] = dict(ttl=holder_ttl_s, horizon=HORIZON_S)
    if last is not None:
        args.update(below=last.below, in_progress=list(last.in_progress))
    subjects = list((await conn.execute(_EXPIRE if last is None else _EXPIRE_SINCE, args)).scalars())
    await conn.execute(text("DELETE FROM admission_holders WHERE seen_at < now() - interval '1 day'"))
    await _leave(conn, jit)
    return subjects


@dataclass(frozen=True)
class Folded:
    rows: int
    expired: list[str] = field(default_factory=list)


async def fold(conn: AsyncConnection, *, now: datetime | None = None) -> int:
    """Rewrite `quota_usage` for the current windows (the current and previous minute, the
    current day, by the database's clock, or `now`: tests cross midnight with it) from what
    the ledger gained since the last fold; older rows stay as last folded and are pruned
    after an hour (minutes) or a week (days). The rows are those a recomputation from the
    whole horizon gives. Rows written."""
    jit = await _enter(conn)
    last = (await conn.execute(_LAST)).first()
    args: dict[str, Any] = dict(horizon=HORIZON_S, now=now, last=last.folded_at if last else None)
    if last is None:  # nothing kept yet: from the horizon, once
        await conn.execute(_STATE_FIRST, args)
        for stmt in _REBUILD:
            await conn.execute(stmt, args)
    else:
        await conn.execute(_STATE, args)  # before the tick reads: what it may miss, the next tick reads
        await conn.execute(_AGE, args)
        await conn.execute(_TICK, dict(below=last.below, in_progress=list(last.in_progress), **args))
    await conn.execute(_PRUNE, args)
    oldest = (await conn.execute(_OLDEST, args)).one()
    if oldest.behind:
        await conn.execute(_PRUNE_RESERVATIONS, dict(since=oldest.since, **args))
    await conn.execute(_FOLD_DELETE, args)
    rows = (await conn.execute(_FOLD_INSERT, args)).rowcount
    await _leave(conn, jit)
    return rows


async def reconcile(conn: AsyncConnection, holder_ttl_s: float) -> Folded:
    """One reconciler tick, in the caller's transaction, under the fold's lock: expire, then
    fold."""
    expired = await expire(conn, holder_ttl_s)
    return Folded(await fold(conn), expired)


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
