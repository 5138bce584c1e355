"""The batch object's `model` and `usage`, as OpenAI has them: the model its input file's
first request names, and the tokens of its completed items, prefix-cache hits apart.

In process: the API on real Postgres and a real Temporal dev server, no control worker (the
test runs validation itself and journals each item's result as an engine worker does).
The oracles are the test's own counts of what it journaled, a plain SQL sum over the
journal's events, and the official `openai` client's reading of the object.
"""

from __future__ import annotations

import io
import json
import os
import uuid

import psycopg
import pytest
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.batch import BatchActivities
from ballast import pg
from config.database import SERVICE_ROLE, as_role, libpq_url
from journal import batch_store
from journal.leases import acquire
from journal.migrate import upgrade
from protocol import keys
from protocol.requests import RequestLimits
from protocol.temporal import ValidateInput
from storage.objects import ObjectStore

MODEL = "ballast-tiny"
# (prompt, completion, cached) of each item that completes; None: the response names no
# cached tokens at all (an engine that does not report them).
DONE = [(120, 30, 64), (80, 7, None), (1500, 250, 1024), (9, 1, 0)]
FAILED, PENDING = 1, 2  # items that fail, and that never run


def lines(model: str, n: int) -> bytes:
    return b"".join(json.dumps(dict(custom_id=f"c{i}", method="POST", url="/v1/chat/completions",
                                    body=dict(model=model, messages=[dict(role="user", content="hi")],
                                              max_tokens=300))).encode() + b"\n" for i in range(n))


def response(prompt: int, completion: int, cached: int | None) -> dict:
    usage: dict = dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    if cached is not None:
        usage["prompt_tokens_details"] = dict(cached_tokens=cached)
    return dict(id="chatcmpl-x", object="chat.completion", model=MODEL, choices=[], usage=usage)


async def settle(db, batch_id: str, idx: int, body: dict | None) -> None:
    """An item's result, as the engine worker that ran it journals it (None: it failed)."""
    async with db.begin() as conn:
        fence = await acquire(conn, keys.item(batch_id, idx), "test")
    ev = (batch_store.item_completed_event(batch_id, idx, "default", body, fence=fence) if body is not None
          else batch_store.item_failed_event(batch_id, idx, "default", 500, {"error": {"message": "no"}},
                                             fence=fence))
    async with db.begin() as conn:
        await batch_store.append_one(conn, ev)


@pytest.fixture
def acts(settings, services_db):
    return BatchActivities(services_db, ObjectStore(settings.object_store_url), RequestLimits(MODEL, 4096), 100)


async def journal_sums(db, batch_id: str) -> tuple[int, int, int]:
    """(input, output, cached) tokens of the batch's completed items, summed in SQL over the
    journal's own events: each result's response text, parsed by Postgres."""
    async with db.connect() as conn:
        row = (await conn.execute(text("""
            SELECT coalesce(sum((r->'usage'->>'prompt_tokens')::bigint), 0),
                   coalesce(sum((r->'usage'->>'completion_tokens')::bigint), 0),
                   coalesce(sum(coalesce((r->'usage'->'prompt_tokens_details'->>'cached_tokens')::bigint, 0)), 0)
              FROM (SELECT (payload->>'body_json')::jsonb AS r FROM events
                     WHERE type = 'item_completed' AND payload->>'batch_id' = :b) done"""), dict(b=batch_id))).one()
    return int(row[0]), int(row[1]), int(row[2])


async def test_usage_is_the_completed_items_tokens_as_the_journal_and_the_client_count_them(
        client, temporal_api, acts, services_db):
    n = len(DONE) + FAILED + PENDING
    f = await client.files.create(file=("in.jsonl", io.BytesIO(lines(MODEL, n))), purpose="batch")
    created = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
    assert created.model == MODEL
    assert created.usage is not None and created.usage.total_tokens == 0
    assert created.usage.input_tokens_details.cached_tokens == 0
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(created.id, MODEL))

    for idx, (p, c, cached) in enumerate(DONE):
        await settle(services_db, created.id, idx, response(p, c, cached))
    for idx in range(len(DONE), len(DONE) + FAILED):
        await settle(services_db, created.id, idx, None)

    mine = (sum(p for p, _, _ in DONE), sum(c for _, c, _ in DONE), sum(x or 0 for _, _, x in DONE))
    assert await journal_sums(services_db, created.id) == mine

    batch = await client.batches.retrieve(created.id)  # the official client's reading
    assert batch.model == MODEL and batch.status == "in_progress"
    assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed,
                                                 batch.request_counts.total) == (len(DONE), FAILED, n)
    u = batch.usage
    assert u is not None
    assert (u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens) == mine
    assert u.total_tokens == mine[0] + mine[1] and u.output_tokens_details.reasoning_tokens == 0

    raw = (await temporal_api.get(f"/v1/batches/{created.id}")).json()
    assert list(raw)[:4] == ["object", "id", "endpoint", "model"]  # OpenAI's order
    assert raw["usage"] == dict(input_tokens=mine[0], input_tokens_details=dict(cached_tokens=mine[2]),
                                output_tokens=mine[1], output_tokens_details=dict(reasoning_tokens=0),
                                total_tokens=mine[0] + mine[1])
    # The extension's own figures stay beside OpenAI's, and agree with them.
    assert (raw["ballast"]["input_tokens"], raw["ballast"]["output_tokens"]) == mine[:2]
    listed = [b for b in (await temporal_api.get("/v1/batches?limit=100")).json()["data"] if b["id"] == created.id]
    assert [b["usage"] for b in listed] == [raw["usage"]] and listed[0]["model"] == MODEL


async def test_a_first_line_no_pool_serves_names_the_deployments_model(client):
    f = await client.files.create(file=("in.jsonl", io.BytesIO(lines("no-such-model", 1))), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.model == MODEL  # what its lines are checked against (and refused by: a 404 each)


async def test_a_batch_journaled_without_a_model_has_none(temporal_api, db):
    """A batch made before its model was journaled (no `batch_model` event): `model` is null,
    and usage is there all the same."""
    bid = "batch_" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=bid, tenant="default", endpoint="/v1/chat/completions",
                                                  input_file_id="file-x", completion_window="24h", metadata=None,
                                                  status="validating", created_at=0, expires_at=1))
    raw = (await temporal_api.get(f"/v1/batches/{bid}")).json()
    assert raw["model"] is None and raw["usage"]["total_tokens"] == 0


def test_the_migration_fills_cached_tokens_from_the_responses_already_journaled(pg_server_url):
    """Items completed before 0022 get their cached tokens from their responses (a NUL in
    the generated text included, which jsonb refuses until it is taken out); failed items 0,
    pending ones none."""
    name = f"ballast_test_0022_{uuid.uuid4().hex[:8]}"
    owner = pg.create_database(pg_server_url, name)
    try:
        service = as_role(owner, SERVICE_ROLE, os.environ.get("BALLAST_SERVICE_DATABASE_PASSWORD"))
        upgrade(owner, "0021", service_url=service)
        bodies = [response(100, 5, 40) | dict(choices=[dict(message=dict(content="a\u0000b"))]),
                  response(10, 5, None), None, None]
        with psycopg.connect(libpq_url(owner)) as conn:
            for idx, body in enumerate(bodies):
                stream = f"item:batch_m:{idx}"
                position = None
                if body is not None or idx == 2:
                    token = conn.execute("INSERT INTO leases (stream, holder) VALUES (%s, 't') RETURNING token",
                                         (stream,)).fetchone()[0]
                    kind = "item_completed" if body is not None else "item_failed"
                    payload = dict(batch_id="batch_m", idx=idx, body_json=json.dumps(body or {}))
                    position = conn.execute(
                        "INSERT INTO events (stream, version, type, payload, idempotency_key, tenant, fence) "
                        "VALUES (%s, 1, %s, %s, %s, 't', %s) RETURNING position",
                        (stream, kind, json.dumps(payload), f"{stream}:result", token)).fetchone()[0]
                status = "completed" if body is not None else "failed" if idx == 2 else "pending"
                conn.execute("INSERT INTO batch_items (batch_id, idx, line, custom_id, body, status, result_position) "
                             "VALUES ('batch_m', %s, %s, 'c', '{}', %s, %s)", (idx, idx + 1, status, position))
        upgrade(owner, service_url=service)
        with psycopg.connect(libpq_url(owner)) as conn:
            got = [r[0] for r in conn.execute("SELECT cached_tokens FROM batch_items ORDER BY idx")]
            assert conn.execute("SELECT model FROM batches").fetchall() == []
        assert got == [40, 0, 0, None]
    finally:
        pg.drop_database(pg_server_url, name)
