"""The auditor role sees its own tenant's rows only, through row-level security, with the
tenant set per transaction: nothing carries over between transactions on a pooled
connection. The audit queries of docs/quotas-and-audit.md run as written."""

from __future__ import annotations

import json
import re
import secrets
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from config.database import as_role, sync_url

AUDIT_DOC = Path(__file__).resolve().parents[2] / "docs" / "quotas-and-audit.md"
AUDITOR = "ballast_auditor"  # migration 0005
TENANTS = ("acme", "globex")


@pytest.fixture(scope="module")
async def books(owner_db):
    """Ledger rows and events for two tenants, written as the owner."""
    run = uuid.uuid4().hex[:8]
    async with owner_db.begin() as c:
        for n, tenant in enumerate(TENANTS, start=1):
            for i in range(n * 2):  # acme: 2 requests, globex: 4
                subject = f"request:audit-{run}-{tenant}-{i}"
                await c.execute(text(
                    "INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, holder,"
                    " idempotency_key) VALUES (:t, 'm', 'default', :s, :k, :i, :o, 'h', :k || ':' || :s)"),
                    [dict(t=tenant, s=subject, k="reserve", i=10, o=100),
                     dict(t=tenant, s=subject, k="settle", i=10, o=7 * (i + 1)),
                     dict(t=tenant, s=subject, k="refund", i=0, o=100 - 7 * (i + 1))])
                await c.execute(text(
                    "INSERT INTO events (stream, version, type, payload, idempotency_key, tenant)"
                    " VALUES (:s, 1, 'request_finished', CAST(:p AS jsonb), :key, :t)"),
                    dict(s=subject, t=tenant, key=f"{subject}:finished",
                         p=json.dumps(dict(prompt_tokens=10, completion_tokens=7 * (i + 1)))))
    async with owner_db.connect() as c:
        truth = {t: (await c.execute(text("SELECT count(*) FROM ledger WHERE tenant = :t"), dict(t=t))).scalar()
                 for t in TENANTS}
    return truth


@pytest.fixture(scope="module")
async def auditor(db_url, owner_db):
    """A login that is a member of the auditor role, behind a pool of ONE connection, so
    consecutive transactions share it as a pooler's would."""
    login, password = f"audit_{uuid.uuid4().hex[:10]}", secrets.token_hex(16)
    async with owner_db.begin() as c:
        await c.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD '{password}' IN ROLE {AUDITOR}"))
    engine = create_async_engine(sync_url(as_role(db_url, login, password)), pool_size=1, max_overflow=0)
    try:
        yield engine
    finally:
        await engine.dispose()
        async with owner_db.begin() as c:
            await c.execute(text(f"DROP ROLE {login}"))


async def _as_tenant(engine, tenant: str | None, sql: str, **params):
    async with engine.begin() as c:
        if tenant is not None:
            await c.execute(text("SELECT set_config('ballast.tenant', :t, true)"), dict(t=tenant))
        pid = (await c.execute(text("SELECT pg_backend_pid()"))).scalar()
        return pid, (await c.execute(text(sql), params)).all()


async def test_each_tenant_sees_its_own_rows_and_nothing_leaks_to_the_next_transaction(books, auditor):
    pids = set()
    for tenant in (*TENANTS, *TENANTS):
        pid, rows = await _as_tenant(auditor, tenant, "SELECT DISTINCT tenant, count(*) OVER () FROM ledger")
        pids.add(pid)
        assert rows == [(tenant, books[tenant])]
        # The same pooled connection, next transaction, no tenant set: nothing at all.
        pid, rows = await _as_tenant(auditor, None, "SELECT count(*) FROM ledger")
        pids.add(pid)
        assert rows == [(0,)]
        _, rows = await _as_tenant(auditor, None, "SELECT count(*) FROM events")
        assert rows == [(0,)]
    assert len(pids) == 1  # every transaction above ran on one connection


async def test_every_table_with_a_tenant_column_has_row_level_security_forced(owner_db):
    """From the catalog: none can be added without it (the owner is subject to it too)."""
    async with owner_db.connect() as c:
        rows = (await c.execute(text(
            "SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity,"
            "       (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'tenant' AND NOT a.attisdropped"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')"))).all()
    assert {r[0] for r in rows} >= {"ledger", "events", "batches", "files", "quota_usage", "fine_tuning_jobs",
                                    "limits", "api_keys"}
    assert [r for r in rows if not (r[1] and r[2] and r[3] >= 1)] == []


@pytest.mark.parametrize("relation", ["events", "usage_by_minute", "usage_by_day", "reserved_vs_settled",
                                      "open_reservations", "batches", "files", "quota_usage", "fine_tuning_jobs"])
async def test_views_and_read_models_are_scoped_too(books, auditor, relation):
    _, rows = await _as_tenant(auditor, "acme", f"SELECT DISTINCT tenant FROM {relation}")
    assert set(r[0] for r in rows) <= {"acme"}
    _, rows = await _as_tenant(auditor, "nobody", f"SELECT count(*) FROM {relation}")
    assert rows == [(0,)]


async def test_the_auditors_usage_matches_the_owners_sum(books, auditor, owner_db):
    _, rows = await _as_tenant(auditor, "globex", "SELECT sum(output_tokens) FROM usage_by_day")
    async with owner_db.connect() as c:
        truth = (await c.execute(text(
            "SELECT sum(output_tokens) FROM ledger WHERE tenant = 'globex' AND kind = 'settle'"))).scalar()
    assert rows[0][0] == truth == 7 * (1 + 2 + 3 + 4)


@pytest.mark.parametrize("sql", [
    "INSERT INTO ledger (tenant, model, tier, subject, kind, input_tokens, output_tokens, idempotency_key)"
    " VALUES ('acme', 'm', 'default', 'x', 'settle', 0, 0, 'x')",
    "UPDATE ledger SET output_tokens = 0",
    "DELETE FROM ledger",
    "UPDATE quota_usage SET requests = 0",
    "SELECT * FROM api_keys",
    "SELECT * FROM limits",
])
async def test_the_auditor_reads_and_nothing_more(books, auditor, sql):
    with pytest.raises(DBAPIError, match="permission denied"):
        await _as_tenant(auditor, "acme", sql)


def _documented_queries() -> list[str]:
    section = AUDIT_DOC.read_text().split("## Auditing quota usage in SQL", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def test_the_audit_doc_carries_at_least_five_queries():
    assert len(_documented_queries()) >= 5


@pytest.mark.parametrize("query", _documented_queries())
async def test_documented_audit_queries_run_as_written(books, auditor, query):
    # As the auditor, tenant set per transaction as the doc says; only the query's own text.
    await _as_tenant(auditor, "acme", query.strip().rstrip(";"))
