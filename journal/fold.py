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

from journal.ledger import HORIZON_S, standing

_FOLD_LOCK = 0x0BA11A57  # pg_advisory_xact_lock key: one fold at a time

# How it works.
#
# The fold is incremental: a tick reads the ledger rows written since the last tick, not
# the day's or the horizon's, and gives the same `quota_usage` rows as recomputing the
# windows from the whole horizon would. It keeps sums, and no row per reservation: the
# ledger itself says how each reservation stood at the last tick, given which of its rows
# that tick read.
# - `quota_fold`: the snapshot the last tick read under, taken by the tick's own statement.
#   A ledger row is new to the fold when that snapshot did not see it: `txid` (the writer's
#   transaction id, the column's default) ≥ the snapshot's xmax, or among its in-progress
#   ids, unless it is the folding transaction's own (`own`, which may be at or above
#   xmax) and was written before the tick (`own_position`: the highest position it had
#   written then). Neither positions nor times alone would do: a bigserial is drawn at
#   INSERT and commits whenever its transaction does, and a reserve row's `at` is the
#   admitting process's clock at admission, written a flush or two later (much later
#   after Postgres was unreachable). So no slack to guess: a transaction that had not
#   ended when the snapshot was taken is new to every tick until one sees it ended,
#   however long it runs.
# - `quota_buckets`: per tenant × model × holder × minute and day (the current and later
#   windows), what the reservations of that window count for; `quota_open_sums`: per
#   tenant × model × holder, the horizon's open reservations (in_flight,
#   batch_queue_tokens).
# A tick takes the subjects with new rows and adds, for each, how it stands now less how
# it stood under the last tick's snapshot (both read off the ledger's subject index), in
# one statement that also records its own snapshot for the next tick. Then `quota_usage`:
# minute rows from the minute buckets, day rows from the day buckets and the open sums.
# Expiry's candidates are the open reservations of holders not seen (each such holder's
# newest reservations, as many as the sums say it had open) and the reservations written
# since the last tick. So a tick costs the rows written since the last one, the
# reservations that leave the horizon, the dead holders' open reservations, and the
# (tenant, model, holder) groups it writes; not the day's or the horizon's rows, and it
# writes no row per reservation. Without a `quota_fold` row (the first tick after a
# migration that reset it) it builds the sums from the horizon, once.
#
# Windows and the horizon move with the clock, not with the ledger: each tick takes out
# of the open sums the reservations that have left the horizon since the last (how they
# stood then), and deletes the buckets of windows that have ended; differences for ended
# windows are dropped. quota_usage keeps its rows and prune rules (minutes for an hour,
# days for a week), and admission reads it as before. The minute sums are kept for the
# current minutes only, not the whole day: a day's total is a bucket of its own, kept by
# the same differences.

# The last tick's snapshot (as text: xid8 has no client type) and clock.
_LAST = text("SELECT CAST(below AS text) AS below, CAST(in_progress AS text[]) AS in_progress, "
             "CAST(own AS text) AS own, own_position, folded_at FROM quota_fold")

# Rows of ledger `{t}` the last tick did not read; `:below`, `:in_progress`, `:own`,
# `:own_position` its snapshot.
# (Its own id may be at or above its xmax: xmax is one past the last transaction to end.)
_NEW_ROWS = ("(({t}.txid >= CAST(:below AS xid8) OR {t}.txid = ANY(CAST(:in_progress AS xid8[]))"
             " OR {t}.txid = CAST(:own AS xid8)) AND NOT coalesce({t}.txid = CAST(:own AS xid8)"
             " AND {t}.position <= coalesce(CAST(:own_position AS bigint), 0), false))")
# Rows it read (rows from before the fold kept snapshots have no txid: read long ago).
_SEEN = "NOT coalesce(" + _NEW_ROWS + ", false)"
# The clock the fold takes its windows at: `:now`, or the transaction's; never before the
# last tick's (`:last`), as a transaction that began before the last tick ended may be
# next: it finds the windows as the last tick left them, pruned of what had ended.
_NOW = "greatest(coalesce(CAST(:now AS timestamptz), now()), CAST(:last AS timestamptz))"
_MINUTE = f"date_trunc('minute', {_NOW}, 'UTC')"
_DAY = f"date_trunc('day', {_NOW}, 'UTC')"
_HORIZON = f"{_NOW} - make_interval(secs => :horizon)"
_LAST_HORIZON = "CAST(:last AS timestamptz) - make_interval(secs => :horizon)"

# This statement's snapshot, which every read of the statement is under: its xmax, the ids
# in progress, this transaction's id if it has one, the highest position this transaction
# had written before the statement, and the clock; written into quota_fold (`state`).
_SNAP = f"""
    snap AS MATERIALIZED (
      SELECT pg_snapshot_xmax(s) AS below, ARRAY(SELECT pg_snapshot_xip(s)) AS in_progress,
             pg_current_xact_id_if_assigned() AS own, {_NOW} AS folded_at
        FROM pg_current_snapshot() AS s
    )"""
# (OFFSET 0: read through the txid index, not backwards along every position for a match.)
_RECORDED = ("SELECT below, in_progress, own, (SELECT max(position) FROM (SELECT position FROM ledger WHERE txid = own"
             " OFFSET 0) o), folded_at FROM snap")
_COLUMNS = "(below, in_progress, own, own_position, folded_at)"
_RECORD_TICK = _SNAP + f", state AS (UPDATE quota_fold SET {_COLUMNS} = ({_RECORDED}))"
_RECORD_FIRST = _SNAP + f", state AS (INSERT INTO quota_fold {_COLUMNS} {_RECORDED})"

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

# Sums per window of `{rows}` (tenant, model, holder, at, interactive, i, o, sign), for
# the windows kept: the previous minute on, the day on.
_BUCKETS = f"""
    INSERT INTO quota_buckets AS b (tenant, model, holder, "window", starts_at, reservations, requests,
                                    input_tokens, output_tokens)
    SELECT d.tenant, d.model, d.holder, w.name, w.starts_at, sum(d.sign),
           coalesce(sum(d.sign) FILTER (WHERE d.interactive), 0),
           coalesce(sum(d.sign * d.i) FILTER (WHERE d.interactive), 0),
           coalesce(sum(d.sign * d.o) FILTER (WHERE d.interactive), 0)
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


def _signed(cte: str, sign: int, where: str = "true", *, buckets: bool = False) -> str:
    cols = "at, interactive, i, o" if buckets else "interactive, held"
    return f"SELECT tenant, model, holder, {cols}, {sign} AS sign FROM {cte} WHERE {where}"


# Planner-proof (the fold's tables change faster than their statistics): an index probe
# per subject, as for an array of them.
_DIRTY = "l.subject = ANY(ARRAY(SELECT subject FROM dirty))"
_OPEN_KEPT = f"open AND at >= {_HORIZON}"

# One statement, one snapshot, which it records: each subject with new rows comes out of
# the sums as it stood under the last tick's snapshot (`was`) and goes in as it stands now;
# the reservations that left the horizon since the last tick leave the open sums as they
# stood then (`aged`).
_TICK = text(
    "WITH" + _RECORD_TICK + ", dirty AS (SELECT DISTINCT subject FROM ledger WHERE "
    + _NEW_ROWS.format(t="ledger") + "),"
    + standing(_DIRTY, name="now") + "," + standing(_DIRTY, _SEEN.format(t="l"), name="was") + ","
    + standing(f"l.at >= {_LAST_HORIZON} AND l.at < {_HORIZON}", _SEEN.format(t="l"), name="aged")
    + ", sums AS (" + _OPEN_SUMS.format(rows=" UNION ALL ".join((
        _signed("now", 1, _OPEN_KEPT), _signed("was", -1, _OPEN_KEPT), _signed("aged", -1, "open")))) + ")"
    + _BUCKETS.format(rows=_signed("now", 1, buckets=True) + " UNION ALL " + _signed("was", -1, buckets=True))
)

_REBUILD = (
    text("DELETE FROM quota_open_sums"),
    text("DELETE FROM quota_buckets"),
    text("WITH" + _RECORD_FIRST + "," + standing(f"l.at >= {_HORIZON}", name="now")
         + ", sums AS (" + _OPEN_SUMS.format(rows=_signed("now", 1, "open")) + ")"
         + _BUCKETS.format(rows=_signed("now", 1, buckets=True))),
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
_CLOSED = "EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('settle', 'refund', 'expire'))"
_EXPIRE_ROWS = f"""
    INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder, idempotency_key, at)
    SELECT r.tenant, r.model, r.tier, r.subject, 'expire', r.input_tokens, r.output_tokens, r.holder,
           'expire:' || r.subject, now()
      FROM ledger r
      LEFT JOIN admission_holders h ON h.holder = r.holder
     WHERE r.kind = 'reserve' AND r.holder IS NOT NULL AND r.at >= now() - make_interval(secs => :horizon)
       AND {_DEAD.format(h="h")} AND NOT {_CLOSED}
       AND {{among}}
     ORDER BY r.position
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING subject
"""
# Before the fold has kept anything: among every reservation of the horizon.
_EXPIRE = text(_EXPIRE_ROWS.format(among="true"))
# Then among the reservations the last tick read and those written since: every open one
# is one or the other. Of dead holders (as a rule none) the first, newest first, as many as
# the open sums counted (the open ones the last tick read are among what it counted, so
# the walk stops at the last of them, however old the holder's reservations go).
_EXPIRE_SINCE = text(
    f"""
    WITH dead AS MATERIALIZED (
      SELECT s.holder, sum(s.reservations) AS open
        FROM quota_open_sums s LEFT JOIN admission_holders h ON h.holder = s.holder
       WHERE s.reservations > 0 AND s.holder <> '' AND {_DEAD.format(h="h")}
       GROUP BY s.holder
    ), candidates AS MATERIALIZED (
      SELECT o.position FROM dead d CROSS JOIN LATERAL (
        SELECT r.position FROM ledger r
         WHERE r.kind = 'reserve' AND r.holder = d.holder AND r.at >= now() - make_interval(secs => :horizon)
           AND {_SEEN.format(t="r")} AND NOT {_CLOSED}
         ORDER BY r.at DESC LIMIT d.open
      ) o
      UNION
      SELECT l.position FROM ledger l LEFT JOIN admission_holders h ON h.holder = l.holder
       WHERE l.kind = 'reserve' AND {_NEW_ROWS.format(t="l")} AND {_DEAD.format(h="h")}
    )"""
    + _EXPIRE_ROWS.format(among="r.position = ANY(ARRAY(SELECT position FROM candidates))")
)


def _since(last: Any) -> dict[str, Any]:
    return dict(below=last.below, in_progress=list(last.in_progress), own=last.own, own_position=last.own_position)


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
        args.update(_since(last))
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
        for stmt in _REBUILD:
            await conn.execute(stmt, args)
    else:
        await conn.execute(_TICK, dict(_since(last), **args))
    await conn.execute(_PRUNE, args)
    await conn.execute(_FOLD_DELETE, args)
    rows = (await conn.execute(_FOLD_INSERT, args)).rowcount
    await _leave(conn, jit)
    return rows


async def reconcile(conn: AsyncConnection, holder_ttl_s: float) -> Folded:
    """One reconciler tick, in the caller's transaction, under the fold's lock: expire, then
    fold."""
    expired = await expire(conn, holder_ttl_s)
    return Folded(await fold(conn), expired)


