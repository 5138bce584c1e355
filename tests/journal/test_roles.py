"""The services' role appends to and reads the journal, and can do nothing else to it:
no rewrite, no schema change, no switching off the triggers. Migrations run as the owner."""

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from alembic import command
from sqlalchemy import text

from ballast import pg
from config.database import SERVICE_ROLE, as_role, libpq_url
from journal import events as j
from journal.migrate import alembic_config, upgrade


async def test_the_service_role_appends_and_reads(db):
    async with db.connect() as c:
        assert (await c.execute(text("SELECT current_user"))).scalar() != "postgres"
    async with db.begin() as c:
        [pos] = await j.append(c, [j.NewEvent("s-role", "note", {"a": 1}, "role-1")])
    async with db.connect() as c:
        assert [e.position for e in await j.read_stream(c, "s-role")] == [pos]


@pytest.mark.parametrize("sql", [
    "UPDATE events SET type = 'x'",
    "DELETE FROM events",
    "TRUNCATE events",
    "ALTER TABLE events DISABLE TRIGGER ALL",
    "ALTER TABLE events DISABLE TRIGGER events_no_update_delete",
    "DROP TRIGGER events_no_update_delete ON events",
    "DROP TRIGGER events_fenced ON events",
    "DROP TABLE events",
    "ALTER TABLE events DROP COLUMN fence",
    "CREATE OR REPLACE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
    "DELETE FROM batches",
    "TRUNCATE batch_items",
    "SET ROLE postgres",
])
def test_the_service_role_cannot_rewrite_or_reshape_the_journal(service_db_url, sql):
    with psycopg.connect(libpq_url(service_db_url)) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(sql)


def test_the_service_role_owns_nothing_and_holds_no_power(service_db_url, db_url):
    with psycopg.connect(libpq_url(db_url)) as conn:
        role = psycopg.conninfo.conninfo_to_dict(libpq_url(service_db_url))["user"]
        attrs = conn.execute(
            "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
            "FROM pg_roles WHERE rolname = %s", (role,),
        ).fetchone()
        assert attrs == (True, False, False, False, False, False)
        owned = conn.execute("SELECT count(*) FROM pg_class WHERE relowner = %s::regrole", (role,)).fetchone()[0]
        assert owned == 0
        events = conn.execute(
            "SELECT array_agg(privilege_type::text ORDER BY privilege_type) FROM information_schema.role_table_grants "
            "WHERE grantee = %s AND table_name = 'events'", (role,),
        ).fetchone()[0]
        assert events == ["INSERT", "SELECT"]


def test_the_owner_migrates_down_and_up_again(pg_server_url):
    """In a database of its own: the session's database keeps its leases and fences."""
    name = f"ballast_test_roles_{uuid.uuid4().hex[:8]}"
    owner = pg.create_database(pg_server_url, name)
    try:
        service = as_role(owner, SERVICE_ROLE, os.environ.get("BALLAST_SERVICE_DATABASE_PASSWORD"))
        upgrade(owner, service_url=service)
        command.downgrade(alembic_config(owner, service), "0003")
        with psycopg.connect(libpq_url(service)) as conn, pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT 1 FROM leases")
        upgrade(owner, service_url=service)
        with psycopg.connect(libpq_url(service)) as conn:
            conn.execute("INSERT INTO leases (stream, token, holder) VALUES ('s', 1, 'me')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("UPDATE events SET type = 'x'")
    finally:
        pg.drop_database(pg_server_url, name)


def test_ballast_migrate_sets_the_services_password_it_is_given_every_time(pg_server_url):
    """The migration that creates the role sets its password once; `ballast migrate` applies
    the configured one on every run, so a changed password reaches the role. A role of its
    own: the shared one's password is the other tests' login."""
    name, role = f"ballast_test_pw_{uuid.uuid4().hex[:8]}", f"ballast_test_svc_{uuid.uuid4().hex[:8]}"
    owner = pg.create_database(pg_server_url, name)

    def migrate(password: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(BALLAST_DATABASE_URL=owner, BALLAST_SERVICE_ROLE=role, BALLAST_SERVICE_DATABASE_PASSWORD=password)
        done = subprocess.run([sys.executable, "-m", "ballast.cli", "migrate"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        with psycopg.connect(libpq_url(owner)) as conn:
            row = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()
            assert row is not None, f"no role {role}"
            return row[0]

    try:
        first = migrate("first-" + uuid.uuid4().hex)
        second = migrate(password := "second-" + uuid.uuid4().hex)
        assert first.startswith("SCRAM-SHA-256$") and second.startswith("SCRAM-SHA-256$") and first != second
        # The new password logs in (proof on a server that asks for it, as the embedded one).
        with psycopg.connect(libpq_url(as_role(owner, role, password))) as conn:
            assert conn.execute("SELECT current_user").fetchone()[0] == role
    finally:
        pg.drop_database(pg_server_url, name)
        with psycopg.connect(libpq_url(pg_server_url), autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')
