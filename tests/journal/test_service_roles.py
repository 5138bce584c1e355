"""Each service's own role on the real server: what the API's, the control worker's and an
engine worker's login can and cannot do. The stacks of tests/e2e log in as these roles, so
every flow they run proves the grants suffice; this proves what they withhold.

The matrix below is what each service does (its code's reads and writes), stated here,
not read from the migration: a table added later fails `test_every_table_is_decided`
until it is decided for every role.
"""

from __future__ import annotations

import secrets
import uuid

import psycopg
import pytest
from psycopg import errors as pgerr

from config.database import SERVICE_ROLES, as_role, libpq_url
from journal import engine_registry
from journal import events as j
from journal.db import connect
from tests.conftest import role_url_for

R, W = "r", "rw"  # read only; read and write (insert or update, as the service does)
_QUOTA = ("quota_usage", "quota_open_sums", "quota_buckets", "quota_fold")
_VIEWS = ("usage_by_minute", "usage_by_hour", "usage_by_day", "open_reservations", "reserved_vs_settled",
          "served_requests", "finished_requests", "batch_promises", "cost_by_tenant")
# table: (api, control, engine); None: no access at all.
MATRIX: dict[str, tuple[str | None, str | None, str | None]] = {
    "events": (W, W, W),  # append-only for everyone (tests/journal/test_roles.py); the engine's kinds only
    "files": (W, W, R),
    "batches": (W, W, R),
    "batch_items": (R, W, W),
    "fine_tuning_jobs": (W, W, R),
    "engines": (W, W, W),  # api: draining only; control: batch_cap only; an engine: its own rows' announcement only
    "leases": (None, W, W),
    "tenants": (W, R, R),
    "api_keys": (W, None, None),
    "limits": (W, R, R),
    "ledger": (W, W, W),
    "admission_holders": (W, W, None),
    "webhooks": (W, R, None),  # the API: every column but `secret`; control: with it, to sign (0021)
    "reservations": (W, R, R),  # the API projects the admin's changes; the others read them
    "allowances": (R, R, R),  # the cells reconciler (ballast_cells) appends them; every service admits by them
    "allowances_in_force": (R, R, R),  # the latest of each, written by the reconciler with its history row
    **{t: (R, W, R) for t in _QUOTA},
    **{t: (R, R, None) for t in _VIEWS},
    "alembic_version": (None, None, None),
}
KINDS = ("api", "control", "engine")


def _privileges(conn: psycopg.Connection, role: str, table: str) -> set[str]:
    def holds(check: str, p: str) -> bool:
        row = conn.execute(f"SELECT {check}(%s, %s, %s)", (role, f"public.{table}", p)).fetchone()
        return bool(row and row[0])

    return {p for p in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
            if holds("has_table_privilege", p)
            or (p in ("SELECT", "INSERT", "UPDATE") and holds("has_any_column_privilege", p))}


def test_every_table_is_decided(db_url):
    with psycopg.connect(libpq_url(db_url)) as conn:
        tables = {r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'm', 'p')")}
    assert tables == set(MATRIX), "decide each new table for every service's role (MATRIX)"


@pytest.mark.parametrize("kind", KINDS)
def test_each_role_holds_only_its_matrix(db_url, kind):
    role = SERVICE_ROLES[kind]
    col = KINDS.index(kind)
    with psycopg.connect(libpq_url(db_url)) as conn:
        attrs = conn.execute("SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
                             "FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        assert attrs == (True, False, False, False, False, False)
        assert conn.execute("SELECT count(*) FROM pg_class WHERE relowner = %s::regrole", (role,)).fetchone()[0] == 0
        for table, access in MATRIX.items():
            held = _privileges(conn, role, table)
            assert not held & {"TRUNCATE", "REFERENCES", "TRIGGER"}, (role, table, held)
            want = access[col]
            assert ("SELECT" in held) == (want is not None), (role, table, held)
            assert bool(held & {"INSERT", "UPDATE", "DELETE"}) == (want == W), (role, table, held)
            if table == "events":
                assert held == {"SELECT", "INSERT"}, (role, held)
        # Under row-level security a grant with no policy for the role reads no row at all.
        for (table,) in conn.execute("SELECT relname FROM pg_class WHERE relrowsecurity AND relkind = 'r'"):
            if MATRIX[table][col] is not None:
                policies = conn.execute("SELECT count(*) FROM pg_policies WHERE tablename = %s AND %s = ANY(roles) "
                                        "AND cmd IN ('ALL', 'SELECT')", (table, role)).fetchone()
                assert policies and policies[0] >= 1, f"{role} may read {table} but no policy lets it see a row"


def _refused(url: str, sql: str, params: tuple = ()) -> None:
    with psycopg.connect(libpq_url(url)) as conn, pytest.raises(pgerr.InsufficientPrivilege):
        conn.execute(sql, params)


# What a compromised host must not do with its service's login.
@pytest.mark.parametrize("kind,sql", [
    *[(k, sql) for k in ("control", "engine") for sql in (
        "INSERT INTO tenants (id) VALUES ('mallory')",
        "UPDATE tenants SET tiers = '{priority}'",
        "INSERT INTO api_keys (id, tenant, hash, prefix, admin) VALUES ('k', NULL, 'h', 'p', true)",
        "UPDATE api_keys SET admin = true",
        "SELECT hash FROM api_keys",
        "UPDATE limits SET requests_per_min = NULL",
        "DELETE FROM limits",
    )],
    ("engine", "UPDATE files SET tenant = 'mallory'"),
    ("engine", "UPDATE batches SET status = 'completed'"),
    ("engine", "UPDATE fine_tuning_jobs SET status = 'succeeded'"),
    ("engine", "DELETE FROM admission_holders"),
    ("engine", "UPDATE engines SET batch_cap = NULL"),  # the fleet controller's
    ("engine", "UPDATE engines SET draining = false"),  # the operator's
    ("engine", "UPDATE engines SET login = 'ballast_api'"),
    ("engine", "INSERT INTO engines (id, url, model, queue, stats, login) "
               "VALUES ('e', 'http://x', 'm', 'q', '{}', 'ballast_api')"),
    ("control", "UPDATE engines SET url = 'http://mallory'"),
    ("control", "INSERT INTO engines (id, url, model, queue, stats) VALUES ('e', 'http://x', 'm', 'q', '{}')"),
    ("api", "UPDATE engines SET url = 'http://mallory'"),
    ("api", "UPDATE engines SET batch_cap = 0"),
    ("api", "INSERT INTO engines (id, url, model, queue, stats) VALUES ('e', 'http://x', 'm', 'q', '{}')"),
    ("api", "DELETE FROM engines"),
    ("api", "INSERT INTO leases (stream, token, holder) VALUES ('s', 1, 'me')"),
    *[(k, f"{verb} events") for k in KINDS for verb in ("DELETE FROM", "TRUNCATE")],
])
def test_a_service_role_cannot_touch_what_its_service_never_does(db_url, kind, sql):
    _refused(role_url_for(db_url, kind), sql)


@pytest.mark.parametrize("kind", ["batch_created", "file_created", "file_deleted", "ft_status", "note"])
def test_an_engine_appends_only_its_own_kinds_of_event(db_url, kind):
    with psycopg.connect(libpq_url(role_url_for(db_url, "engine"))) as conn:
        with pytest.raises(pgerr.InsufficientPrivilege, match="row-level security"):
            conn.execute("INSERT INTO events (stream, version, type, payload, idempotency_key, tenant) "
                         "VALUES (%s, 1, %s, '{}', %s, 't')", (f"s-{uuid.uuid4().hex}", kind, uuid.uuid4().hex))


async def test_an_engine_appends_what_it_generates(db_url):
    db = connect(role_url_for(db_url, "engine"), pool_size=1)
    try:
        async with db.begin() as conn:
            [pos] = await j.append(conn, [j.NewEvent(f"s-{uuid.uuid4().hex}", "ft_event", {"message": "m"},
                                                     uuid.uuid4().hex, "t")])
        assert pos is not None
    finally:
        await db.dispose()


@pytest.fixture
def engine_logins(db_url):
    """Two engine hosts' own logins, each a member of the engine role: the URLs."""
    names = [f"ballast_test_host_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    urls = []
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        for name in names:
            password = secrets.token_urlsafe(16)
            conn.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE ballast_engine").format(
                psycopg.sql.Identifier(name), psycopg.sql.Literal(password)))
            urls.append(as_role(db_url, name, password))
    try:
        yield urls
    finally:
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            for name in names:
                conn.execute(psycopg.sql.SQL("DELETE FROM engines WHERE login = {}").format(psycopg.sql.Literal(name)))
                conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(name)))


async def test_an_engine_host_announces_and_withdraws_only_its_own_row(db_url, engine_logins):
    a, b = (connect(u, pool_size=1) for u in engine_logins)
    ids = [f"host-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        for db, id in zip((a, b), ids, strict=True):
            async with db.begin() as conn:
                assert await engine_registry.announce(conn, id, f"http://{id}:1", "m", "q", {}) == (None, False)
        # Host A re-announcing host B's id (to take its traffic) is refused, as is any change
        # to B's row; B's row is not even visible to A.
        async with a.begin() as conn:
            with pytest.raises(Exception, match="row-level security|InsufficientPrivilege"):
                await engine_registry.announce(conn, ids[1], "http://mallory:1", "m", "q", {})
        async with a.begin() as conn:
            await engine_registry.withdraw(conn, ids[1])
            gone = await conn.exec_driver_sql("UPDATE engines SET url = 'http://mallory:1' WHERE id = %s", (ids[1],))
            assert gone.rowcount == 0
        with psycopg.connect(libpq_url(db_url)) as conn:
            rows = dict(conn.execute("SELECT id, url FROM engines WHERE id = ANY(%s)", (ids,)).fetchall())
            logins = dict(conn.execute("SELECT id, login FROM engines WHERE id = ANY(%s)", (ids,)).fetchall())
        assert rows == {ids[0]: f"http://{ids[0]}:1", ids[1]: f"http://{ids[1]}:1"}
        assert [logins[i] for i in ids] == [psycopg.conninfo.conninfo_to_dict(libpq_url(u))["user"]
                                            for u in engine_logins]
        async with a.begin() as conn:
            await engine_registry.withdraw(conn, ids[0])
        with psycopg.connect(libpq_url(db_url)) as conn:
            left = [r[0] for r in conn.execute("SELECT id FROM engines WHERE id = ANY(%s)", (ids,))]
        assert left == [ids[1]]
    finally:
        await a.dispose()
        await b.dispose()


async def test_the_control_role_caps_any_engine(db_url, engine_logins):
    host = connect(engine_logins[0], pool_size=1)
    control = connect(role_url_for(db_url, "control"), pool_size=1)
    id = f"host-{uuid.uuid4().hex[:8]}"
    try:
        async with host.begin() as conn:
            await engine_registry.announce(conn, id, "http://h:1", "m", "q", {})
        async with control.begin() as conn:
            await engine_registry.set_caps(conn, [(id, 2)])
        async with host.begin() as conn:
            assert await engine_registry.announce(conn, id, "http://h:1", "m", "q", {}) == (2, False)
    finally:
        await host.dispose()
        await control.dispose()
