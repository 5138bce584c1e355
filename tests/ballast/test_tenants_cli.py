"""`ballast tenants …` as a user runs it: a subprocess on the test database (DATABASE_URL,
as the owner). What it printed is checked against the database, and a key it printed
against sha256 computed here."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from config.database import libpq_url
from journal import batch_store
from journal.db import connect
from protocol import keys


def ballast(db_url: str | None, *args: str, data_dir=None, **more_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BALLAST_DATABASE_URL")} | more_env
    if db_url is not None:
        env["DATABASE_URL"] = db_url
    if data_dir is not None:
        env["BALLAST_DATA_DIR"] = str(data_dir)
    return subprocess.run([sys.executable, "-m", "ballast.cli", "tenants", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def rows(db_url: str, sql: str, *params) -> list[tuple]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.fixture
def name() -> str:
    return "cli-" + uuid.uuid4().hex[:8]


def test_create_list_keys_revoke(db_url, name):
    done = ballast(db_url, "create", name, "--weight", "3")
    key = ok(done).strip()
    assert key.startswith("sk-ballast-") and "\n" not in key  # stdout is the key alone
    assert name in done.stderr and "shown this once" in done.stderr
    [(key_id, tenant, stored, prefix, admin, revoked)] = rows(
        db_url, "SELECT id, tenant, hash, prefix, admin, revoked_at FROM api_keys WHERE tenant = %s", name)
    assert (tenant, stored, admin, revoked) == (name, hashlib.sha256(key.encode()).hexdigest(), False, None)
    assert key.startswith(prefix) and len(prefix) < 20
    assert rows(db_url, "SELECT weight FROM tenants WHERE id = %s", name) == [(3,)]

    listed = ok(ballast(db_url, "list")).splitlines()
    assert listed[0].split()[:2] == ["TENANT", "WEIGHT"]
    assert any(line.split()[:2] == [name, "3"] for line in listed[1:])

    second = ok(ballast(db_url, "new-key", name, "--key-name", "ci")).strip()
    assert second.startswith("sk-ballast-") and second != key
    keys = ok(ballast(db_url, "keys", name))
    assert key_id in keys and prefix in keys and " ci " in keys
    assert key not in keys and second not in keys and stored not in keys  # never the key, never its hash

    out = ok(ballast(db_url, "revoke", key_id))
    assert key_id in out and "revoked" in out
    assert rows(db_url, "SELECT revoked_at IS NOT NULL FROM api_keys WHERE id = %s", key_id) == [(True,)]
    line = next(ln for ln in ok(ballast(db_url, "keys", name)).splitlines() if ln.startswith(key_id))
    assert line.split()[-1] != "-"  # a REVOKED time


def test_a_new_tenant_gets_the_configured_limits(db_url, name):
    """Every dimension bounded from the start, as the settings say (BALLAST_NEW_TENANT_LIMITS)."""
    from config.api import NEW_TENANT_LIMITS
    from protocol.limits import LIMITS

    ok(ballast(db_url, "create", name))
    [got] = rows(db_url, f"SELECT model, {', '.join(LIMITS)} FROM limits WHERE tenant = %s", name)
    assert got == ("*", *(NEW_TENANT_LIMITS[d] for d in LIMITS)) and None not in got
    ok(ballast(db_url, "create", name + "-x", BALLAST_NEW_TENANT_LIMITS='{"requests_per_min": 7}'))
    assert rows(db_url, "SELECT model, requests_per_min, tokens_per_day FROM limits WHERE tenant = %s",
                name + "-x") == [("*", 7, None)]


def test_an_admin_key_belongs_to_no_tenant(db_url):
    done = ballast(db_url, "admin-key", "--key-name", "ops")
    key = ok(done).strip()
    assert key.startswith("sk-ballast-") and "no tenant" in done.stderr
    [(tenant, admin, label)] = rows(db_url, "SELECT tenant, admin, name FROM api_keys WHERE hash = %s",
                                    hashlib.sha256(key.encode()).hexdigest())
    assert (tenant, admin, label) == (None, True, "ops")
    assert ballast(db_url, "create", "x-" + uuid.uuid4().hex[:6], "--admin").returncode == 2  # no such option


def test_limits_show_set_and_clear(db_url, name):
    ok(ballast(db_url, "create", name, BALLAST_NEW_TENANT_LIMITS="{}"))
    assert "no limits" in ok(ballast(db_url, "limits", name))
    ok(ballast(db_url, "limits", name, "--requests-per-min", "60", "--tokens-per-day", "100000"))
    ok(ballast(db_url, "limits", name, "--model", "ballast-tiny", "--concurrent-requests", "4",
               "--concurrent-fine-tunes", "2"))
    ok(ballast(db_url, "limits", name, "--tokens-per-day", "none"))  # clears that one, keeps the rest
    got = rows(db_url, "SELECT model, requests_per_min, tokens_per_day, concurrent_requests, concurrent_fine_tunes "
                       "FROM limits WHERE tenant = %s ORDER BY model", name)
    assert got == [("*", 60, None, None, None), ("ballast-tiny", None, None, 4, 2)]
    shown = ok(ballast(db_url, "limits", name)).splitlines()
    assert shown[0].split()[:3] == ["MODEL", "REQUESTS_PER_MIN", "INPUT_TOKENS_PER_MIN"]
    assert shown[1].split() == ["*", "60", "-", "-", "-", "-", "-", "-"]  # '*' first
    assert shown[2].split() == ["ballast-tiny", "-", "-", "-", "4", "-", "-", "2"]


def test_tiers_are_granted_and_taken_back(db_url, name):
    ok(ballast(db_url, "create", name))
    assert "no tier granted" in ok(ballast(db_url, "tiers", name))
    assert "priority granted" in ok(ballast(db_url, "tiers", name, "--set", "priority"))
    assert rows(db_url, "SELECT tiers FROM tenants WHERE id = %s", name) == [(["priority"],)]
    assert any(line.split()[:3] == [name, "1", "priority"] for line in ok(ballast(db_url, "list")).splitlines())
    ok(ballast(db_url, "tiers", name, "--none"))
    assert rows(db_url, "SELECT tiers FROM tenants WHERE id = %s", name) == [([],)]


@pytest.mark.parametrize("args, says", [
    (["create", "Not_Valid!"], "Invalid tenant id"),
    (["create", "system"], "reserved"),
    (["tiers", "no-such-tenant", "--set", "priority"], "No tenant"),
    (["tiers", "default", "--set", "flex"], "Invalid tier"),
    (["keys", "no-such-tenant"], "No tenant"),
    (["revoke", "key_nope"], "No key"),
    (["limits", "no-such-tenant", "--requests-per-min", "5"], "No tenant"),
])
def test_mistakes_are_one_line_and_exit_1(db_url, args, says):
    done = ballast(db_url, *args)
    assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_taken_name_is_refused(db_url, name):
    ok(ballast(db_url, "create", name))
    done = ballast(db_url, "create", name)
    assert done.returncode == 1 and "already exists" in done.stderr
    assert rows(db_url, "SELECT count(*) FROM api_keys WHERE tenant = %s", name) == [(1,)]  # no second key


def test_a_bad_number_is_a_usage_error(db_url, name):
    done = ballast(db_url, "limits", name, "--requests-per-min", "-1")
    assert done.returncode == 2 and "negative" in done.stderr


def test_without_a_database_it_says_what_to_do(tmp_path):
    done = ballast(None, "list", data_dir=tmp_path)
    assert done.returncode == 1 and "ballast up" in done.stderr and "DATABASE_URL" in done.stderr


def test_the_url_a_running_ballast_up_leaves_is_used(db_url, tmp_path, name):
    (tmp_path / "postgres-url").write_text(db_url)
    ok(ballast(None, "create", name, data_dir=tmp_path))
    assert rows(db_url, "SELECT id FROM tenants WHERE id = %s", name) == [(name,)]


def test_erase_removes_a_tenants_files_and_records_it(db_url, name, tmp_path):
    """The CLI's erasure as the owner, with the object store of BALLAST_DATA_DIR: the file's
    row and bytes go, the erasure is journaled with what it did. (The whole of erasure is
    tests/e2e/test_erasure.py.)"""
    ok(ballast(db_url, "create", name))
    dry = ballast(db_url, "erase", name, data_dir=tmp_path)  # without --yes: only what it would do
    assert dry.returncode == 0 and "nothing runs" in dry.stderr, dry.stderr
    file_id = "file-" + uuid.uuid4().hex[:24]
    key = keys.file(file_id)
    (tmp_path / "objects" / key).parent.mkdir(parents=True)
    (tmp_path / "objects" / key).write_bytes(b"secret")

    async def upload() -> None:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                await batch_store.create_file(conn, dict(id=file_id, tenant=name, purpose="batch", filename="s.jsonl",
                                                         bytes=6, object_key=key, created_at=0))
        finally:
            await db.dispose()

    asyncio.run(upload())
    done = ballast(db_url, "erase", name, "--yes", data_dir=tmp_path)
    assert done.returncode == 0 and "erased the content" in done.stderr, done.stderr
    assert not (tmp_path / "objects" / key).exists()
    assert rows(db_url, "SELECT count(*) FROM files WHERE tenant = %s", name) == [(0,)]
    [(by, files, objects)] = rows(db_url, "SELECT payload->>'by', payload->'files', payload->'objects' FROM events "
                                          "WHERE tenant = %s AND type = 'content_erased'", name)
    assert (by, files, objects) == ("cli", 1, 1)
    gone = ballast(db_url, "erase", "no-such-tenant", "--yes", data_dir=tmp_path)
    assert gone.returncode == 1 and "No tenant" in gone.stderr
