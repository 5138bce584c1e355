"""The journal's invariants, each one SQL query that returns its violations, and one that
counts the rows it examined.

Plain SQL over `events`, `batch_items`, `batches`, `files` and `ledger`, and the views
`served_requests` and `finished_requests` (a row per request of the events that list
them; what the auditor role may read too), on purpose: an auditor can run the same queries by hand (`ballast
verify` runs them), and none of them trusts the code that wrote the rows. Some hold at
every moment; the rest (`at_rest`) only once nothing runs: no batch in flight, every
request's stream ended and swept.

The ledger is checked against figures written by someone else than the ledger's writer,
or computed differently: a request's settle against what the engine worker recorded
vLLM counted (`served_requests`, written by the engine worker, not the API); a batch
item's settled completion tokens against the token ids its chunks journaled; a training
checkpoint's settle against the job's epochs and the tokens an epoch holds (its
checkpoint events, the job's hyperparameters) and the trained_tokens the job reported.

A check passes only if it looked at something: each reports how many rows it examined,
one that examined none says "nothing to check", and the audit as a whole passes only
when no check found a violation (or could not run) and at least one row was examined.
So an empty journal, or a role that row-level security hides every row from (the
auditor outside a tenant's transaction), fails rather than reading as all-ok.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from config.database import libpq_url
from protocol import keys


@dataclass(frozen=True)
class Check:
    name: str
    what: str  # the invariant, as a sentence
    sql: str  # its violations, one row each
    examined: str  # one row, one column: how many rows the check looked at
    unit: str  # what `examined` counts, plural
    at_rest: bool = False


@dataclass
class Finding:
    check: Check
    violations: int
    examples: list[tuple[Any, ...]] = field(default_factory=list)
    examined: int = 0
    error: str | None = None  # the check could not run (a permission, a missing table)

    @property
    def ok(self) -> bool:
        """No violation and no error (a check that examined nothing is ok, and says so)."""
        return self.violations == 0 and self.error is None

    @property
    def state(self) -> str:
        if not self.ok:
            return "FAIL"
        return "ok" if self.examined else "none"


_ITEM_RESULTS = "type IN ('item_completed', 'item_failed')"
_ITEM_STREAM = "'item:' || i.batch_id || ':' || i.idx"

CHECKS = (
    Check("item_results_once",
          "every item of a completed batch has a result; an item's result is the one its unique key admits "
          "(<stream>:result), no other; the item's read model (status, result_position) is that result",
          f"""
          WITH i AS (SELECT i.batch_id, i.idx, {_ITEM_STREAM} AS stream, i.status, i.result_position,
                            b.status AS batch_status
                       FROM batch_items i JOIN batches b ON b.id = i.batch_id),
               r AS (SELECT stream, position, type, idempotency_key FROM events WHERE {_ITEM_RESULTS})
          SELECT coalesce(i.stream, r.stream) AS stream, i.batch_status, i.status, i.result_position,
                 r.position, r.type, r.idempotency_key
            FROM i FULL JOIN r ON r.stream = i.stream
           WHERE i.stream IS NULL  -- a result of no item
              OR (i.batch_status = 'completed' AND r.position IS NULL)
              OR r.idempotency_key <> r.stream || ':result'
              OR i.result_position IS DISTINCT FROM r.position
              OR i.status <> CASE r.type WHEN 'item_completed' THEN 'completed'
                                         WHEN 'item_failed' THEN 'failed' ELSE 'pending' END
          """,
          "SELECT count(*) FROM batch_items", "items"),
    Check("chunks_contiguous", "each item's journaled chunks (of each of its choices) start at offset 0 and follow "
                               "one another, no gap, no overlap",
          """
          SELECT stream, choice, off, expected FROM (
            SELECT stream, coalesce((payload->>'choice')::int, 0) AS choice, (payload->>'offset')::int AS off,
                   coalesce(lag((payload->>'offset')::int + jsonb_array_length(payload->'token_ids'))
                              OVER (PARTITION BY stream, coalesce((payload->>'choice')::int, 0)
                                    ORDER BY (payload->>'offset')::int), 0) AS expected
              FROM events WHERE type = 'item_chunk') c
           WHERE off <> expected
          """,
          "SELECT count(*) FROM events WHERE type = 'item_chunk'", "chunks"),
    Check("fences_only_rise", "within a stream, no event carries an older attempt's fence than one before it",
          """
          SELECT stream, position, fence, newest FROM (
            SELECT stream, position, fence,
                   max(fence) OVER (PARTITION BY stream ORDER BY position
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS newest
              FROM events WHERE fence IS NOT NULL) f
           WHERE fence < newest
          """,
          "SELECT count(*) FROM events WHERE fence IS NOT NULL", "fenced events"),
    Check("completed_batches_have_files", "a completed batch names an output or error file, and every file it names "
                                          "exists, or its deletion (by its owner, or at its expiry) is journaled",
          """
          WITH gone AS (SELECT stream FROM events WHERE type = 'file_deleted')
          SELECT b.id, b.output_file_id, b.error_file_id FROM batches b
           WHERE b.status = 'completed'
             AND ((b.output_file_id IS NULL AND b.error_file_id IS NULL)
                  OR (b.output_file_id IS NOT NULL AND NOT EXISTS (SELECT FROM files f WHERE f.id = b.output_file_id)
                      AND NOT EXISTS (SELECT FROM gone WHERE stream = 'file:' || b.output_file_id))
                  OR (b.error_file_id IS NOT NULL AND NOT EXISTS (SELECT FROM files f WHERE f.id = b.error_file_id)
                      AND NOT EXISTS (SELECT FROM gone WHERE stream = 'file:' || b.error_file_id)))
          """,
          "SELECT count(*) FROM batches WHERE status = 'completed'", "completed batches"),
    Check("ledger_equals_journal",
          "every settle in the ledger is of an outcome the journal records, and every such outcome is settled, "
          "in its tier: a request's (request_finished), a batch item's result (tier batch), a training "
          "checkpoint's (ftjob:<id>:<step>, tier training)",
          """
          WITH j AS (
            SELECT 'request:' || request_id AS subject, 'request' AS what FROM finished_requests
            UNION ALL
            SELECT stream, 'item' FROM events WHERE type IN ('item_completed', 'item_failed')
            UNION ALL
            SELECT 'ftjob:' || (payload->>'job_id') || ':' || (payload->>'step'), 'training'
              FROM events WHERE type = 'ft_checkpoint'),
          l AS (SELECT subject, tier FROM ledger WHERE kind = 'settle')
          SELECT coalesce(j.subject, l.subject) AS subject, j.what, l.tier
            FROM j FULL JOIN l ON l.subject = j.subject
           WHERE j.subject IS NULL OR l.subject IS NULL
              OR (j.what = 'item') <> (l.tier = 'batch')
              OR (j.what = 'training') <> (l.tier = 'training')
          """,
          """
          SELECT (SELECT count(*) FROM ledger WHERE kind = 'settle') + (SELECT count(*) FROM finished_requests)
               + (SELECT count(*) FROM events WHERE type IN ('item_completed', 'item_failed', 'ft_checkpoint'))
          """, "settles and outcomes"),
    Check("request_tokens_match_engine",
          "a request's settled tokens are what its engine worker recorded vLLM counted (request_served): the "
          "prompt always; the completion exactly once the request completed, at most that if it was cut short",
          """
          WITH l AS (SELECT substr(subject, length('request:') + 1) AS rid, input_tokens AS i, output_tokens AS o
                       FROM ledger WHERE kind = 'settle' AND subject LIKE 'request:%'),
               s AS (SELECT request_id AS rid, (record->>'prompt_tokens')::bigint AS i,
                            (record->>'completion_tokens')::bigint AS o
                       FROM served_requests),
               f AS (SELECT request_id AS rid, status FROM finished_requests)
          SELECT l.rid, f.status, l.i AS settled_in, l.o AS settled_out, s.i AS served_in, s.o AS served_out
            FROM l JOIN s ON s.rid = l.rid LEFT JOIN f ON f.rid = l.rid
           WHERE l.i <> s.i OR l.o > s.o
              OR (l.o <> s.o AND coalesce(f.status, '') NOT IN ('cancelled', 'failed'))
          """,
          """
          SELECT count(*) FROM ledger l JOIN served_requests s ON l.subject = 'request:' || s.request_id
           WHERE l.kind = 'settle'
          """, "requests settled and served"),
    Check("item_tokens_match_chunks",
          "a completed batch item settles as many completion tokens as its chunks journaled token ids (at most "
          "that where the request has stop strings: a resumed run may overshoot one); a failed item settles none",
          f"""
          WITH l AS (SELECT subject, input_tokens AS i, output_tokens AS o
                       FROM ledger WHERE kind = 'settle' AND subject LIKE 'item:%'),
               r AS (SELECT stream, type FROM events WHERE {_ITEM_RESULTS}),
               c AS (SELECT stream, sum(jsonb_array_length(payload->'token_ids')) AS n
                       FROM events WHERE type = 'item_chunk' GROUP BY stream),
               stops AS (SELECT {_ITEM_STREAM} AS stream,
                                CASE jsonb_typeof(i.body->'stop')
                                  WHEN 'string' THEN i.body->>'stop' <> ''
                                  WHEN 'array' THEN jsonb_array_length(i.body->'stop') > 0
                                  ELSE false END AS has_stop
                           FROM batch_items i)
          SELECT l.subject, r.type, l.i AS settled_in, l.o AS settled_out, coalesce(c.n, 0) AS journaled,
                 stops.has_stop
            FROM l JOIN r ON r.stream = l.subject
            LEFT JOIN c ON c.stream = l.subject
            LEFT JOIN stops ON stops.stream = l.subject
           WHERE (r.type = 'item_failed' AND (l.i <> 0 OR l.o <> 0))
              OR (r.type = 'item_completed'
                  AND (l.o > coalesce(c.n, 0) OR (l.o <> coalesce(c.n, 0) AND NOT coalesce(stops.has_stop, false))))
          """,
          f"""
          SELECT count(*) FROM ledger l JOIN events r ON r.stream = l.subject AND r.{_ITEM_RESULTS}
           WHERE l.kind = 'settle'
          """, "items settled"),
    Check("training_tokens_match_checkpoints",
          "a fine-tuning job's settles, summed to each checkpoint, lie within the epochs it had trained (epoch = "
          "total_steps / n_epochs steps, tokens_per_epoch tokens: exact at an epoch's end), settle no output "
          "tokens, and sum to the trained_tokens the job reported when it succeeded",
          """
          WITH job AS (SELECT payload->>'id' AS job, (payload->'hyperparameters'->>'n_epochs')::bigint AS epochs
                         FROM events WHERE type = 'ft_job_created'),
               ck AS (SELECT payload->>'job_id' AS job, (payload->>'step')::bigint AS step,
                             (payload->>'tokens_per_epoch')::bigint AS per_epoch,
                             (payload->>'total_steps')::bigint AS total_steps
                        FROM events WHERE type = 'ft_checkpoint'),
               st AS (SELECT substring(subject FROM '^ftjob:(.*):[0-9]+$') AS job,
                             substring(subject FROM ':([0-9]+)$')::bigint AS step,
                             input_tokens AS i, output_tokens AS o
                        FROM ledger WHERE kind = 'settle' AND subject LIKE 'ftjob:%'),
               b AS (SELECT ck.job, ck.step, ck.per_epoch, ck.total_steps / nullif(job.epochs, 0) AS per,
                            ck.total_steps % nullif(job.epochs, 0) AS odd,
                            (SELECT sum(st.i) FROM st WHERE st.job = ck.job AND st.step <= ck.step) AS settled,
                            (SELECT sum(st.o) FROM st WHERE st.job = ck.job AND st.step <= ck.step) AS out
                       FROM ck LEFT JOIN job ON job.job = ck.job)
          SELECT 'checkpoint' AS what, job, step, settled, per_epoch * (step / per) AS low,
                 per_epoch * ((step + per - 1) / per) AS high, out
            FROM b
           WHERE per IS NULL OR per = 0 OR odd <> 0 OR per_epoch IS NULL OR settled IS NULL OR out <> 0
              OR settled < per_epoch * (step / per) OR settled > per_epoch * ((step + per - 1) / per)
          UNION ALL
          SELECT 'succeeded', t.job, NULL, (SELECT sum(st.i) FROM st WHERE st.job = t.job), t.told, t.told, NULL
            FROM (SELECT payload->>'job_id' AS job, (payload->>'trained_tokens')::bigint AS told
                    FROM events WHERE type = 'ft_status' AND payload->>'status' = 'succeeded') t
           WHERE (SELECT sum(st.i) FROM st WHERE st.job = t.job) IS DISTINCT FROM t.told
          """,
          "SELECT count(*) FROM events WHERE type = 'ft_checkpoint'", "checkpoints"),
    Check("batches_ended", "no batch is left unfinished",
          """
          SELECT id, status FROM batches
           WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired')
          """,
          "SELECT count(*) FROM batches", "batches", at_rest=True),
    Check("requests_accounted", "every request an engine served is journaled as finished",
          """
          SELECT s.request_id, s.committed_at FROM served_requests s
           WHERE NOT EXISTS (SELECT FROM finished_requests f WHERE f.request_id = s.request_id)
          """,
          "SELECT count(*) FROM served_requests", "served requests", at_rest=True),
    Check("reservations_closed", "every quota reservation is settled, refunded or expired",
          "SELECT subject, tier, holder, at FROM open_reservations",
          "SELECT count(*) FROM ledger WHERE kind = 'reserve'", "reservations", at_rest=True),
)


# With a tokenizer (`ballast verify --tokenizer DIR`): each completed batch item's settled
# prompt tokens against its request re-tokenized by transformers from the journaled body.
# Only the prompt: a completion's text does not re-tokenize to the ids generated in
# general (EOS is not in the text, a stop string is cut from it, a BPE model's re-encoding
# of generated text need not be the ids it sampled); its count is checked against the
# journaled ids instead (item_tokens_match_chunks).
RETOKENIZED = Check(
    "item_prompts_retokenized",
    "a completed batch item settles as many prompt tokens as its request's messages (rendered with the "
    "tokenizer's chat template) or prompt hold, re-tokenized by transformers",
    """
    SELECT l.subject, l.model, l.input_tokens, b.endpoint, i.body
      FROM ledger l
      JOIN events r ON r.stream = l.subject AND r.type = 'item_completed'
      JOIN batch_items i ON l.subject = 'item:' || i.batch_id || ':' || i.idx
      JOIN batches b ON b.id = i.batch_id
     WHERE l.kind = 'settle'
    """,
    "", "items re-tokenized")


def audit(db_url: str, *, at_rest: bool = True, examples: int = 5, tokenizer: str | None = None,
          model: str | None = None) -> list[Finding]:
    """Every check (only those that hold at every moment unless `at_rest`), run as the
    URL's role in one read-only snapshot. A check that cannot run (the role may not read
    a table) is a finding with its error, not an exception: the others still run. With
    `tokenizer` (a model directory or hub id), also `RETOKENIZED`, over the items of
    `model` and its fine-tuned models (every item's, without)."""
    out = []
    with psycopg.connect(libpq_url(db_url)) as conn:
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            for check in CHECKS:
                if check.at_rest and not at_rest:
                    continue
                out.append(_run(conn, check, examples))
            if tokenizer is not None:
                out.append(_retokenized(conn, tokenizer, model, examples))
    return out


def _retokenized(conn: psycopg.Connection, tokenizer: str, model: str | None, examples: int) -> Finding:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    bad: list[tuple[Any, ...]] = []
    seen = 0
    try:
        with conn.transaction(), conn.cursor(name="retokenized") as cur:  # streamed: a journal may be large
            cur.execute(RETOKENIZED.sql)
            for subject, item_model, settled, endpoint, body in cur:
                ours = model is None or item_model == model or item_model.startswith(keys.fine_tuned_prefix(model))
                if not ours:
                    continue
                n = _prompt_tokens(tok, endpoint, body)
                if n is None:
                    continue  # a body it cannot render by OpenAI's rules alone: not examined
                seen += 1
                if n != settled:
                    bad.append((subject, settled, n))
    except psycopg.Error as err:
        return Finding(RETOKENIZED, 0, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
    return Finding(RETOKENIZED, len(bad), bad[:examples], seen)


def _prompt_tokens(tok: Any, endpoint: str, body: dict[str, Any]) -> int | None:
    """The request's prompt tokens, as OpenAI's API defines the prompt and the model's own
    tokenizer encodes it: chat messages through its chat template (text parts joined),
    a completion's prompt with the tokenizer's special tokens, or the ids it gave; an
    embedding's inputs, each so."""
    if endpoint.endswith("/embeddings"):
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and all(isinstance(t, int) for t in inputs)):
            inputs = [inputs]
        if not isinstance(inputs, list):
            return None
        special = body.get("add_special_tokens") is not False
        return sum(len(one) if isinstance(one, list) else len(tok(one, add_special_tokens=special)["input_ids"])
                   for one in inputs)
    if endpoint.endswith("/chat/completions"):
        messages = []
        for m in body.get("messages") or []:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                return None
            messages.append(dict(role=m.get("role"), content=content))
        if not messages:
            return None
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses these messages: not examined
            return None
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(tok(prompt)["input_ids"])
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None


def _run(conn: psycopg.Connection, check: Check, examples: int) -> Finding:
    try:
        with conn.transaction():  # a savepoint: an error here leaves the snapshot usable
            rows = conn.execute(check.sql).fetchall()
            row = conn.execute(check.examined).fetchone()
    except psycopg.Error as err:
        return Finding(check, 0, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
    return Finding(check, len(rows), rows[:examples], int(row[0]) if row else 0)


def examined(findings: list[Finding]) -> int:
    return sum(f.examined for f in findings)


def passed(findings: list[Finding]) -> bool:
    """The audit's verdict: no check failed, and at least one row was examined."""
    return all(f.ok for f in findings) and examined(findings) > 0


def report(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        seen = f"({f.examined:,} {f.check.unit} examined)"
        if f.error is not None:
            tail = f" — could not run: {f.error}"
        elif f.violations:
            tail = f" — {f.violations:,} violations {seen}"
        elif not f.examined:
            tail = f" — nothing to check {seen}"
        else:
            tail = f" {seen}"
        lines.append(f"{f.state:<4} {f.check.name}: {f.check.what}{tail}")
        lines += [f"       {row}" for row in f.examples]
    lines.append(verdict(findings))
    return "\n".join(lines)


def verdict(findings: list[Finding]) -> str:
    failed = [f.check.name for f in findings if not f.ok]
    if failed:
        return f"FAILED: {', '.join(failed)}"
    if not examined(findings):
        return ("FAILED: nothing examined: the journal is empty, or this role sees none of it "
                "(row-level security shows the auditor only the tenant set for its transaction)")
    quiet = [f.check.name for f in findings if not f.examined]
    return (f"passed: {len(findings) - len(quiet)} checks over {examined(findings):,} rows"
            + (f"; nothing to check for {', '.join(quiet)}" if quiet else ""))
