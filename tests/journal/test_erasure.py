"""The database's side of erasure (migration 0019): the journal stays append-only for every
role and statement except `ballast_erase_content`, which only the API's role may call, and
which masks the content of a tenant's ended batches alone: a running batch's items keep
their requests, another tenant's events are untouched, and nothing but `payload` changes.
The request as written (`body_json`, 0023) and the logprobs journaled with tokens go with
them. The end-to-end erasure (files, objects, the API) is tests/e2e/test_erasure.py."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from config.database import SERVICE_ROLES, libpq_url
from tests.conftest import migrated_database, role_url_for


def _seed(conn: psycopg.Connection, tenant: str, batch: str, status: str) -> None:
    conn.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, created_at, seq)"
                 " VALUES (%s, %s, '/v1/completions', 'file-x', '24h', %s, 0, 0)", (batch, tenant, status))
    request = dict(prompt=f"secret of {batch}")
    conn.execute("INSERT INTO batch_items (batch_id, idx, line, custom_id, body, body_json, status) VALUES "
                 "(%s, 0, 1, 'c0', %s, %s, 'completed')", (batch, json.dumps(request), json.dumps(request)))
    rows = [("item_created", dict(batch_id=batch, idx=0, line=1, custom_id="c0", body=request,
                                  body_json=json.dumps(request))),
            ("item_chunk", dict(batch_id=batch, idx=0, offset=0, token_ids=[5, 6, 7], runner="r",
                                logprobs=[[[5, -0.5], [9, -1.5]]] * 3)),
            ("item_completed", dict(batch_id=batch, idx=0, body_json=json.dumps(
                dict(choices=[dict(text="secret \x00answer")], usage=dict(prompt_tokens=4, completion_tokens=3)))))]
    stream = f"item:{batch}:0"
    ((fence,),) = conn.execute("INSERT INTO leases (stream, token, holder) VALUES (%s, 0, 'r') RETURNING token",
                               (stream,)).fetchall()
    for version, (kind, payload) in enumerate(rows, 1):
        conn.execute("INSERT INTO events (stream, version, type, payload, idempotency_key, tenant, fence)"
                     " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                     (stream, version, kind, json.dumps(payload), f"{batch}:{kind}", tenant,
                      None if kind == "item_created" else fence))


def _payloads(conn: psycopg.Connection, batch: str) -> dict[str, dict]:
    return dict(conn.execute("SELECT type, payload FROM events WHERE stream = %s", (f"item:{batch}:0",)).fetchall())


@pytest.fixture
def db_url(pg_server_url):
    """A database of its own: the rows seeded here are not projections of their events."""
    with migrated_database(pg_server_url, "ballast_erasure") as url:
        yield url


def test_only_the_erasure_function_masks_and_only_ended_batches(db_url):
    tag = uuid.uuid4().hex[:8]
    tenant, other = f"er-{tag}", f"er-other-{tag}"
    ended, running, theirs = f"batch_e{tag}", f"batch_r{tag}", f"batch_o{tag}"
    with psycopg.connect(libpq_url(db_url), autocommit=True) as owner:
        _seed(owner, tenant, ended, "completed")
        _seed(owner, tenant, running, "in_progress")
        _seed(owner, other, theirs, "completed")
        before = {b: _payloads(owner, b) for b in (ended, running, theirs)}

        # Nobody rewrites the journal by hand, the owner included, nor with the setting a
        # statement of its own could set but for columns other than the payload.
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only: UPDATE on events"):
            owner.execute("UPDATE events SET payload = '{}' WHERE tenant = %s", (tenant,))
        with owner.transaction():
            owner.execute("SELECT set_config('ballast.erasing', %s, true)", (tenant,))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                owner.execute("UPDATE events SET type = 'x' WHERE tenant = %s", (tenant,))
        for kind in ("control", "engine"):
            with psycopg.connect(libpq_url(role_url_for(db_url, kind))) as conn:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute("SELECT ballast_erase_content(%s)", (tenant,))
        with psycopg.connect(libpq_url(role_url_for(db_url, "api"))) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):  # the setting opens nothing to a service
                conn.execute("SELECT set_config('ballast.erasing', %s, false)", (tenant,))
                conn.execute("UPDATE events SET payload = '{}' WHERE tenant = %s", (tenant,))

        with psycopg.connect(libpq_url(role_url_for(db_url, "api")), autocommit=True) as api:
            (counts,) = api.execute("SELECT ballast_erase_content(%s)", (tenant,)).fetchone()
            assert (counts["requests"], counts["chunks"], counts["results"]) == (1, 1, 1)
            (again,) = api.execute("SELECT ballast_erase_content(%s)", (tenant,)).fetchone()
            assert (again["requests"], again["chunks"], again["results"]) == (0, 0, 0)
            assert api.execute("SELECT current_setting('ballast.erasing', true)").fetchone()[0] in (None, "")

        masked = _payloads(owner, ended)
        assert masked["item_created"]["body"] == {"erased": True} and "body_json" not in masked["item_created"]
        assert masked["item_chunk"]["token_ids"] == [-1, -1, -1] and "logprobs" not in masked["item_chunk"]
        assert json.loads(masked["item_completed"]["body_json"]) == dict(
            erased=True, usage=dict(prompt_tokens=4, completion_tokens=3))
        for kind, payload in before[ended].items():  # every other field as it was
            content = ("body", "token_ids", "body_json", "logprobs")
            assert {k: v for k, v in masked[kind].items() if k not in content} == \
                {k: v for k, v in payload.items() if k not in content}
        assert _payloads(owner, running) == before[running] and _payloads(owner, theirs) == before[theirs]
        bodies = {b: (body, text) for b, body, text in owner.execute(
            "SELECT batch_id, body, body_json FROM batch_items WHERE batch_id IN (%s, %s, %s)",
            (ended, running, theirs)).fetchall()}
        kept = {b: (dict(prompt=f"secret of {b}"), json.dumps(dict(prompt=f"secret of {b}")))
                for b in (running, theirs)}
        assert bodies == {ended: ({"erased": True}, None), **kept}
        assert SERVICE_ROLES["api"] == "ballast_api"  # the role 0019 grants the function to
