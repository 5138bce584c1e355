"""The embedded Postgres asks every role for its password: the superuser (made per
installation, kept 0600 beside the cluster) and the services' role alike. What the server
itself says is the judge: whom it lets in, its own view of pg_hba.conf, its catalog."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ballast import pg, procs
from config.database import SERVICE_ROLE, SERVICE_ROLES, as_role, libpq_url
from journal.migrate import upgrade


@pytest.fixture(autouse=True)
def _no_ambient_password(monkeypatch):
    # libpq would fall back on these where a URL has no password: a refusal must be the server's.
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", os.devnull)


def _data_dir() -> Iterator[Path]:
    # Not under pytest's tmp root: see tests/conftest.py pg_server_url.
    path = Path(tempfile.mkdtemp(prefix="ballast-test-pgauth-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installation() -> Iterator[tuple[pg.EmbeddedPostgres, str, str]]:
    """An embedded server, and a migrated database on it: (server, owner URL, services' URL)."""
    for root in _data_dir():
        server = pg.EmbeddedPostgres(root).start()
        try:
            owner = pg.create_database(server.url, "journal")
            service = as_role(owner, SERVICE_ROLE, secrets.token_urlsafe(16))
            upgrade(owner, service_url=service)
            for role in SERVICE_ROLES.values():  # as `ballast migrate` and `ballast up` do
                pg.set_password(owner, role, secrets.token_urlsafe(16))
            yield server, owner, service
        finally:
            server.stop()


def _login(url: str, password: str | None) -> str:
    """Connect to `url` as its user with `password` (None: none at all); current_user."""
    u = make_url(url)
    target = as_role(url, u.username or "", password)
    with psycopg.connect(libpq_url(target), connect_timeout=10) as conn:
        row = conn.execute("SELECT current_user").fetchone()
        assert row is not None
        return row[0]


@pytest.mark.parametrize("who", ["superuser", "service"])
def test_no_role_gets_in_without_its_password(installation, who):
    server, owner, service = installation
    url = owner if who == "superuser" else service
    u = make_url(url)
    assert u.password  # the URL ballast hands out carries it
    for wrong in (None, "", "not-" + u.password, u.password.upper()):
        with pytest.raises(psycopg.OperationalError, match="password"):
            _login(url, wrong)
    assert _login(url, u.password) == u.username
    assert u.username == (pg.PG_USER if who == "superuser" else SERVICE_ROLE)


def test_the_server_trusts_no_one(installation):
    server, owner, service = installation
    with psycopg.connect(libpq_url(owner)) as conn:
        rules = conn.execute("SELECT type, auth_method, error FROM pg_hba_file_rules ORDER BY rule_number").fetchall()
        verifiers = dict(conn.execute("SELECT rolname, rolpassword FROM pg_authid WHERE rolcanlogin").fetchall())
        [(encryption,)] = conn.execute("SHOW password_encryption").fetchall()
    assert rules and {t for t, _, _ in rules} >= {"local", "host"}, rules  # the socket and TCP
    assert all(method == "scram-sha-256" and error is None for _, method, error in rules), rules
    assert encryption == "scram-sha-256"
    assert set(verifiers) == {pg.PG_USER, SERVICE_ROLE, *SERVICE_ROLES.values()}
    assert all(v and v.startswith("SCRAM-SHA-256$") for v in verifiers.values()), verifiers


def test_the_superuser_password_is_kept_0600_beside_the_cluster(installation):
    server, owner, _ = installation
    path = server.password_file
    assert path.parent == server.data_dir and server.pgdata not in path.parents
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == make_url(owner).password
    assert not (server.data_dir / ".initdb-password").exists()  # initdb's copy is gone


def test_set_password_gives_a_role_its_password(installation):
    """As `ballast up` does for the services' role a trust-era data dir made without one."""
    _, owner, _ = installation
    role, password = "ballast_test_no_password", secrets.token_urlsafe(16)
    with psycopg.connect(libpq_url(owner), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        url = as_role(owner, role, password)
        with pytest.raises(psycopg.OperationalError, match="password"):
            _login(url, password)  # it has none: no password matches
        pg.set_password(owner, role, password)
        assert _login(url, password) == role
        with pytest.raises(psycopg.OperationalError, match="password"):
            _login(url, None)
    finally:
        with psycopg.connect(libpq_url(owner), autocommit=True) as conn:
            conn.execute(f"DROP ROLE {role}")


def test_a_cluster_made_with_trust_gets_a_password_before_it_listens(installation):
    """A data dir from before passwords: initdb --auth=trust, a superuser without one."""
    for root in _data_dir():
        old = pg.EmbeddedPostgres(root)
        old.pgdata.mkdir(parents=True)
        if old._os_user is not None:
            old._prepare_for_os_user(old._os_user)
        subprocess.run([pg._bin("initdb"), "-D", old.pgdata, "-U", pg.PG_USER, "--auth=trust", "--no-locale",
                        "--encoding=UTF8"], check=True, capture_output=True, **procs.as_user(old._os_user))
        assert " trust" in (old.pgdata / "pg_hba.conf").read_text()
        assert not old.password_file.exists()

        server = pg.EmbeddedPostgres(root).start()
        try:
            url = server.url
            password = make_url(url).password
            assert password and password != make_url(installation[1]).password  # per installation
            with pytest.raises(psycopg.OperationalError, match="password"):
                _login(url, None)
            assert _login(url, password) == pg.PG_USER
            with psycopg.connect(libpq_url(url)) as conn:
                methods = {m for (m,) in conn.execute("SELECT auth_method FROM pg_hba_file_rules").fetchall()}
            assert methods == {"scram-sha-256"}
        finally:
            server.stop()


def test_compose_initdb_script_gives_temporal_a_role_of_its_own(installation):
    """deploy/postgres/10-temporal-role.sh, run as the postgres image runs its init scripts
    (bash, psql as the owner), on a real server: Temporal's login owns its two databases,
    holds no power, logs in by its password only, and cannot read the journal. Twice: the
    second run changes nothing but the password."""
    server, owner, _ = installation
    u = make_url(server.url)
    script = Path(__file__).resolve().parents[2] / "deploy" / "postgres" / "10-temporal-role.sh"
    bin_dir = str(pg._bin("psql").parent)

    def run(password: str) -> None:
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], PGHOST="127.0.0.1",
                   PGPORT=str(u.port), PGPASSWORD=u.password or "", POSTGRES_USER=pg.PG_USER, POSTGRES_DB="postgres",
                   TEMPORAL_DB_PASSWORD=password)
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    run("first-" + secrets.token_hex(8))
    run(password := "second-" + secrets.token_hex(8))
    with psycopg.connect(libpq_url(server.url)) as conn:
        attrs = conn.execute("SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolbypassrls FROM pg_roles "
                             "WHERE rolname = 'temporal'").fetchone()
        assert attrs == (True, False, False, False, False)
        owned = conn.execute("SELECT datname FROM pg_database WHERE datdba = 'temporal'::regrole "
                             "ORDER BY datname").fetchall()
        assert owned == [("temporal",), ("temporal_visibility",)]
    temporal = as_role(make_url(server.url).set(database="temporal").render_as_string(hide_password=False),
                       "temporal", password)
    with pytest.raises(psycopg.OperationalError, match="password"):
        _login(temporal, "first-wrong")
    with psycopg.connect(libpq_url(temporal), autocommit=True) as conn:  # its schema job creates tables
        conn.execute("CREATE TABLE schema_version (v int)")
    journal = as_role(owner, "temporal", password)
    with psycopg.connect(libpq_url(journal)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT count(*) FROM events")
