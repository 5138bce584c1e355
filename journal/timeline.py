"""The fleet's recent past, bucketed, from the journal: interactive TTFT (p50 and p99),
batch throughput, and which pools were surging. What the console's live timeline draws
(GET /admin/timeline); one query.

- Interactive requests: each request's outcome (`finished_requests`: the events its
  window, or the reconciler from the engine's record, journaled), `ttft_ms` among it (as
  the API saw it: request received → first token out; none for a request abandoned before
  one). A request counts in the bucket its event was committed in; percentiles are over the
  requests that have a TTFT (`percentile_cont`: interpolated, as numpy's default).
- Batch tokens: each `item_chunk` event's `token_ids` (their count survives an erasure,
  which masks the ids), summed per bucket and divided by the bucket's width.
- Surges: `surge_started` / `surge_ended` on streams `fleet:<pool>` (workflows/fleet.py).
  A pool is surging in a bucket when one of its surges overlaps it: its state as the window
  opens (its last surge event before, read per pool through the (stream, version) index),
  then its events inside the window. The pools asked about are those of the engines table
  and those with a surge event inside the window.

`committed_at` is the time its transaction began (`now()`), so the window's rows are found
from the newest row committed at least `SLACK_S` before the window opens, by position
(the primary key), not by a scan of the whole journal on every poll: an event whose
transaction was open longer than that when it was written is missed. No journal writer
holds one open that long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from protocol.events import EventType

MAX_BUCKETS = 2000
SLACK_S = 600.0


@dataclass(frozen=True)
class Window:
    """Buckets of `step` seconds from `start` (since, floored to a multiple of `step`, so
    that buckets stay put from one poll to the next), `n` of them, the last ending at or
    after `until`."""

    start: int
    until: float
    step: int
    n: int


def window(since: float, until: float, step: int) -> Window:
    """The buckets covering [since, until); ValueError where they are not a sane window."""
    if not (math.isfinite(since) and math.isfinite(until)):
        raise ValueError("since and until must be finite unix times")
    if step < 1:
        raise ValueError("step must be at least 1 second")
    if until <= since:
        raise ValueError("until must be after since")
    start = math.floor(since / step) * step
    n = max(1, math.ceil((until - start) / step))
    if n > MAX_BUCKETS:
        raise ValueError(f"{n} buckets of {step} s from since to until: at most {MAX_BUCKETS}; "
                         "ask for a larger step or a later since")
    return Window(start, until, step, n)


@dataclass(frozen=True)
class Bucket:
    t: int  # unix seconds: the bucket's start
    chat_requests: int  # interactive requests journaled in it (chat and completions)
    chat_ttft_p50_ms: float | None  # None: none of them had a first token
    chat_ttft_p99_ms: float | None
    batch_tokens: int  # batch tokens journaled in it
    batch_tokens_per_s: float
    surging: tuple[str, ...]  # pools surging at any moment of it, sorted


_TIMELINE = text("""
WITH lo AS (
  SELECT coalesce((SELECT position FROM events WHERE committed_at < to_timestamp(:floor)
                    ORDER BY position DESC LIMIT 1), 0) AS p),
win AS (
  SELECT e.position, e.stream, e.type, e.payload, e.committed_at,
         floor((extract(epoch FROM e.committed_at)::float8 - :start) / :step)::int AS i
    FROM events e, lo
   WHERE e.position > lo.p
     AND e.committed_at >= to_timestamp(:start) AND e.committed_at < to_timestamp(:until)
     AND e.type IN (:chunk, :started, :ended)),
chat AS (
  SELECT floor((extract(epoch FROM f.committed_at)::float8 - :start) / :step)::int AS i, count(*) AS n,
         percentile_cont(0.5) WITHIN GROUP (ORDER BY (f.record->>'ttft_ms')::float8) AS p50,
         percentile_cont(0.99) WITHIN GROUP (ORDER BY (f.record->>'ttft_ms')::float8) AS p99
    FROM finished_requests f, lo
   WHERE f.position > lo.p AND f.committed_at >= to_timestamp(:start) AND f.committed_at < to_timestamp(:until)
   GROUP BY 1),
tok AS (
  SELECT i, sum(CASE jsonb_typeof(payload->'token_ids') WHEN 'array' THEN jsonb_array_length(payload->'token_ids')
                     ELSE 0 END) AS n
    FROM win WHERE type = :chunk GROUP BY i),
pools AS (
  SELECT model AS pool FROM engines
   UNION
  SELECT substr(stream, length('fleet:') + 1) FROM win WHERE type IN (:started, :ended) AND stream LIKE 'fleet:%'),
marks AS (
  SELECT p.pool, to_timestamp(:start) AS at, 0::bigint AS position, s.type
    FROM pools p CROSS JOIN LATERAL (
         SELECT type FROM events
          WHERE stream = 'fleet:' || p.pool AND type IN (:started, :ended) AND committed_at < to_timestamp(:start)
          ORDER BY version DESC LIMIT 1) s
   UNION ALL
  SELECT substr(stream, length('fleet:') + 1), committed_at, position, type
    FROM win WHERE type IN (:started, :ended) AND stream LIKE 'fleet:%'),
spans AS (
  SELECT pool, type, at, lead(at) OVER (PARTITION BY pool ORDER BY at, position) AS next_at FROM marks),
surges AS MATERIALIZED (
  SELECT pool, at AS a, coalesce(next_at, to_timestamp(:until)) AS b FROM spans WHERE type = :started)
SELECT g.i, coalesce(c.n, 0) AS n, c.p50, c.p99, coalesce(k.n, 0) AS tokens,
       coalesce((SELECT array_agg(DISTINCT s.pool ORDER BY s.pool) FROM surges s
                  WHERE s.a < to_timestamp(:start + (g.i + 1) * :step)
                    AND s.b > to_timestamp(:start + g.i * :step)), '{}') AS surging
  FROM generate_series(0, :n - 1) AS g(i)
  LEFT JOIN chat c ON c.i = g.i
  LEFT JOIN tok k ON k.i = g.i
 ORDER BY g.i
""")


async def timeline(conn: AsyncConnection, w: Window) -> list[Bucket]:
    """Every bucket of the window, oldest first, empty ones included."""
    rows = await conn.execute(_TIMELINE, dict(
        floor=float(w.start) - SLACK_S, start=float(w.start), until=float(w.until), step=float(w.step), n=w.n,
        chunk=EventType.ITEM_CHUNK.value,
        started=EventType.SURGE_STARTED.value, ended=EventType.SURGE_ENDED.value))
    out = []
    for i, n, p50, p99, tokens, surging in rows.all():
        out.append(Bucket(w.start + i * w.step, int(n), _ms(p50), _ms(p99), int(tokens),
                          round(int(tokens) / w.step, 3), tuple(surging)))
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)
