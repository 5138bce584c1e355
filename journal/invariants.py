"""The journal's invariants, each one SQL query that returns its violations.

Plain SQL over `events`, `batch_items`, `batches` and `ledger`, on purpose: an auditor can
run the same queries by hand (`ballast verify` runs them), and none of them trusts the
code that wrote the rows. Some hold at every moment; the rest (`at_rest`) only once
nothing runs: no batch in flight, every request's stream ended and swept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from journal.db import libpq_url


@dataclass(frozen=True)
class Check:
    name: str
    what: str  # the invariant, as a sentence
    sql: str  # its violations, one row each
    at_rest: bool = False


@dataclass
class Finding:
    check: Check
    violations: int
    examples: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violations == 0


_ITEM_RESULTS = "e.type IN ('item_completed', 'item_failed')"

CHECKS = (
    Check("item_results_once", "every batch item has at most one result, and exactly one once its batch completed",
          f"""
          SELECT i.batch_id, i.idx, b.status, count(e.position) AS results
            FROM batch_items i
            JOIN batches b ON b.id = i.batch_id
            LEFT JOIN events e ON e.stream = 'item:' || i.batch_id || ':' || i.idx AND {_ITEM_RESULTS}
           GROUP BY i.batch_id, i.idx, b.status
          HAVING count(e.position) > 1 OR (b.status = 'completed' AND count(e.position) <> 1)
          """),
    Check("chunks_contiguous", "each item's journaled chunks start at offset 0 and follow one another, no gap, "
                               "no overlap",
          """
          SELECT stream, off, expected FROM (
            SELECT stream, (payload->>'offset')::int AS off,
                   coalesce(lag((payload->>'offset')::int + jsonb_array_length(payload->'token_ids'))
                              OVER (PARTITION BY stream ORDER BY (payload->>'offset')::int), 0) AS expected
              FROM events WHERE type = 'item_chunk') c
           WHERE off <> expected
          """),
    Check("fences_only_rise", "within a stream, no event carries an older attempt's fence than one before it",
          """
          SELECT stream, position, fence, newest FROM (
            SELECT stream, position, fence,
                   max(fence) OVER (PARTITION BY stream ORDER BY position
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS newest
              FROM events WHERE fence IS NOT NULL) f
           WHERE fence < newest
          """),
    Check("completed_batches_have_files", "a completed batch names an output or error file, and every file it names "
                                          "exists",
          """
          SELECT b.id, b.output_file_id, b.error_file_id FROM batches b
           WHERE b.status = 'completed'
             AND ((b.output_file_id IS NULL AND b.error_file_id IS NULL)
                  OR (b.output_file_id IS NOT NULL AND NOT EXISTS (SELECT FROM files f WHERE f.id = b.output_file_id))
                  OR (b.error_file_id IS NOT NULL AND NOT EXISTS (SELECT FROM files f WHERE f.id = b.error_file_id)))
          """),
    Check("ledger_equals_journal", "the ledger settles exactly the tokens the journal records, once per request and "
                                   "per batch item result",
          rf"""
          WITH j AS (
            SELECT 'request:' || (payload->>'request_id') AS subject, (payload->>'prompt_tokens')::bigint AS i,
                   (payload->>'completion_tokens')::bigint AS o
              FROM events WHERE type = 'request_finished'
            UNION ALL
            -- Read from the body's text, not cast to JSON: generated text may hold NUL,
            -- which Postgres's JSON functions refuse. The keys cannot occur unescaped inside
            -- a JSON string, so the only match is the usage's own.
            SELECT stream, coalesce(substring(payload->>'body_json' FROM '"prompt_tokens":\s*(\d+)')::bigint, 0),
                   coalesce(substring(payload->>'body_json' FROM '"completion_tokens":\s*(\d+)')::bigint, 0)
              FROM events e WHERE {_ITEM_RESULTS}),
          l AS (SELECT subject, input_tokens AS i, output_tokens AS o FROM ledger WHERE kind = 'settle')
          SELECT coalesce(j.subject, l.subject), j.i, j.o, l.i, l.o
            FROM j FULL JOIN l ON l.subject = j.subject
           WHERE j.subject IS NULL OR l.subject IS NULL OR (j.i, j.o) IS DISTINCT FROM (l.i, l.o)
          """),
    Check("batches_ended", "no batch is left unfinished",
          """
          SELECT id, status FROM batches
           WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired')
          """, at_rest=True),
    Check("requests_accounted", "every request an engine served is journaled as finished",
          """
          SELECT s.payload->>'request_id', s.committed_at FROM events s
           WHERE s.type = 'request_served'
             AND NOT EXISTS (SELECT FROM events f
                              WHERE f.idempotency_key = 'request:' || (s.payload->>'request_id') || ':finished')
          """, at_rest=True),
    Check("reservations_closed", "every quota reservation is settled, refunded or expired",
          "SELECT subject, tier, holder, at FROM open_reservations", at_rest=True),
)


def audit(db_url: str, *, at_rest: bool = True, examples: int = 5) -> list[Finding]:
    """Every check (only those that hold at every moment unless `at_rest`), run as the
    URL's role in one read-only snapshot."""
    out = []
    with psycopg.connect(libpq_url(db_url)) as conn:
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        for check in CHECKS:
            if check.at_rest and not at_rest:
                continue
            rows = conn.execute(check.sql).fetchall()
            out.append(Finding(check, len(rows), rows[:examples]))
    return out


def report(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        mark = "ok  " if f.ok else "FAIL"
        lines.append(f"{mark} {f.check.name}: {f.check.what}" + ("" if f.ok else f" — {f.violations} violations"))
        lines += [f"       {row}" for row in f.examples]
    return "\n".join(lines)
