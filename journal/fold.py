"""The quota ledger folded into `quota_usage`: the reconciler's tick (expire, then fold).

The fold (`fold`, the reconciler's every tick) attributes each reservation to the window
of its reserve row's `at` (fixed UTC minute and day windows) and counts it as reserved
while open, as settled once settled, as 0 tokens once refunded or expired unsettled; a
request counts once in `requests` whatever became of it. `in_flight` is the open
interactive reservations, `batch_queue_tokens` the open batch reservations. It reads only
what the ledger gained since the last tick (see "the reconciler" below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.ledger import HORIZON_S, STANDING

_FOLD_LOCK = 0x0BA11A57  # pg_advisory_xact_lock key: one fold at a time

# How it works.
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

# From the standing `x` (STANDING) of some reservations: into quota_reservations those
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
    + STANDING.format(where=_DIRTY.format(t="ledger")) + f""",
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
    text("WITH" + STANDING.format(where=f"at >= {_HORIZON}") + "," + _PUT
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


