"""The local-stack plumbing: process supervision, the Temporal dev server, embedded Postgres."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client

from ballast import procs
from ballast.pg import EmbeddedPostgres, create_database, drop_database
from ballast.temporal_server import TemporalDevServer
from config.database import libpq_url
from config.database import sync_url as sqlalchemy_url  # the name these tests grew up with

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def gone(pid: int) -> bool:
    """Exited (a zombie counts: PID 1 here need not reap the orphans it inherits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# --- procs -----------------------------------------------------------------------------


def test_stop_kills_grandchildren(tmp_path: Path) -> None:
    child = procs.spawn("sleeper", ["bash", "-c", "sleep 1000 & sleep 1000"], log_path=tmp_path / "c.log")
    procs.wait_until(lambda: len(procs.group_members(child.pid)) == 3, 10, "bash and its two sleeps")
    members = procs.group_members(child.pid)
    assert child.alive and child.pid in members

    child.stop(timeout=5)

    assert not child.alive
    assert procs.group_members(child.pid) == []
    assert all(gone(pid) for pid in members)


def test_stop_sigkills_what_ignores_sigterm() -> None:
    child = procs.spawn("stubborn", ["bash", "-c", "trap '' TERM; sleep 1000 & wait"])
    procs.wait_until(lambda: len(procs.group_members(child.pid)) == 2, 10, "bash and its sleep")
    started = time.monotonic()
    child.stop(timeout=0.5)
    assert procs.group_members(child.pid) == []
    assert time.monotonic() - started < 5


def test_child_dies_with_sigkilled_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from ballast import procs
        child = procs.spawn("sleeper", ["sleep", "1000"])
        print(child.pid, flush=True)
        time.sleep(1000)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    assert parent.stdout is not None
    try:
        grandchild = int(parent.stdout.readline())
        assert not gone(grandchild)
        parent.kill()
        parent.wait()
        procs.wait_until(lambda: gone(grandchild), 5, f"orphaned sleep {grandchild} to die")
    finally:
        parent.kill()
        parent.wait()


def autogroup(pid: int | str) -> str | None:
    """The scheduling autogroup of `pid`: None where the kernel has none, or where `pid` is
    in a cgroup of its own that CPU is shared by (the kernel then prints nothing)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def test_a_child_in_our_session_is_a_group_of_its_own_and_shares_our_autogroup(tmp_path: Path) -> None:
    """Where the kernel schedules by session, nice ranks processes of one session only: a
    stack keeps its processes in its session to rank them. Stopping still stops its group."""
    apart = procs.spawn("apart", ["sleep", "1000"])
    kept = procs.spawn("kept", ["bash", "-c", "sleep 1000 & sleep 1000"], session=False)
    try:
        assert os.getsid(apart.pid) == apart.pid and os.getsid(kept.pid) == os.getsid(0)
        assert os.getpgid(kept.pid) == kept.pid != os.getpgid(0)
        if autogroup("self") is not None:
            assert autogroup(kept.pid) == autogroup("self") != autogroup(apart.pid)
        procs.wait_until(lambda: len(procs.group_members(kept.pid)) == 3, 10, "bash and its two sleeps")
        members = procs.group_members(kept.pid)
    finally:
        kept.stop(timeout=5)
        apart.stop(timeout=5)
    assert procs.group_members(kept.pid) == [] and all(gone(pid) for pid in members)


def test_a_niced_child_and_every_thread_it_starts_run_at_the_lower_priority(tmp_path: Path) -> None:
    log = tmp_path / "nice.log"
    code = ("import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.nice(0))); "
            "t.start(); t.join(); print(os.nice(0), seen[0])")
    child = procs.spawn("niced", [sys.executable, "-c", code], log_path=log, nice=5)
    child.proc.wait(10)
    base = os.nice(0)
    assert log.read_text().split() == [str(base + 5), str(base + 5)]


def test_wait_until_names_what_and_log(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    child = procs.spawn("sleeper", ["bash", "-c", "echo hello from the child; sleep 1000"], log_path=log)
    try:
        procs.wait_until(lambda: log.exists() and "hello" in log.read_text(), 5, "the greeting")
        with pytest.raises(TimeoutError) as err:
            procs.wait_until(lambda: False, 0.2, "the moon", child=child)
        assert "the moon" in str(err.value) and str(log) in str(err.value)
        assert "hello from the child" in str(err.value)
    finally:
        child.stop()

    dead = procs.spawn("quitter", ["bash", "-c", "exit 3"], log_path=log)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="quitter exited with code 3"):
        procs.wait_until(lambda: False, 30, "Godot", child=dead)
    assert time.monotonic() - started < 5


def test_free_port_is_bindable() -> None:
    port = procs.free_port()
    assert procs.port_is_free(port)
    assert not procs.port_open(port)


# --- Temporal dev server ---------------------------------------------------------------


async def test_temporal_dev_server_persists_and_stops_clean(tmp_path: Path) -> None:
    server = TemporalDevServer(tmp_path)  # headless, free port
    assert "--headless" in server.argv()
    assert "matching.enableFairness=true" in server.argv()
    server.start()
    try:
        client = await Client.connect(server.address)
        ns = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
        assert ns.namespace_info.name == "default"
        # No worker needed: the workflow just waits in its task queue.
        await client.start_workflow("Nothing", id="persist-me", task_queue="nobody-polls")
    finally:
        server.stop()
    assert server.child is not None and not server.child.alive
    assert procs.group_members(server.child.pid) == []
    assert (tmp_path / "temporal.db").exists()

    # Restart on the same file, this time with the Web UI.
    again = TemporalDevServer(tmp_path, ui_port=procs.free_port())
    assert "--headless" not in again.argv()
    again.start()
    try:
        client = await Client.connect(again.address)
        desc = await client.get_workflow_handle("persist-me").describe()
        assert desc.workflow_type == "Nothing"
        assert again.ui_url is not None
        with urllib.request.urlopen(again.ui_url, timeout=10) as resp:
            assert resp.status == 200
    finally:
        again.stop()
    assert again.child is not None and procs.group_members(again.child.pid) == []


def test_temporal_start_failure_is_clear(tmp_path: Path) -> None:
    # A server that cannot start: the error comes at once, not at the timeout, with the log.
    server = TemporalDevServer(tmp_path, extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="temporal dev server exited") as err:
        server.start(timeout=30)
    assert str(tmp_path / "temporal.log") in str(err.value)


# --- embedded Postgres -----------------------------------------------------------------


def postgres_pids_for(pgdata: Path) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if str(pgdata).encode() in cmdline and not gone(int(entry)):
            out.append(int(entry))
    return out


@pytest.fixture
def pg_dir():
    """A data dir outside pytest's tmp root.

    As root the server runs as an unprivileged user that must traverse every ancestor of
    its data dir, and each pytest session started as root (other runs on this machine)
    chmods /tmp/pytest-of-root back to 0700, which can break an initdb or a start.
    """
    path = Path(tempfile.mkdtemp(prefix="ballast-test-pg-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_embedded_postgres_persists_and_orphans_nothing(pg_dir: Path) -> None:
    pg = EmbeddedPostgres(pg_dir).start()
    try:
        u = make_url(pg.url)  # the superuser, by its password: the server trusts no one
        assert (u.drivername, u.username, u.host) == ("postgresql+psycopg", "postgres", "127.0.0.1") and u.password
        with psycopg.connect(libpq_url(pg.url), autocommit=True) as conn:
            [version] = conn.execute("SELECT version()").fetchall()[0]
            assert version.startswith("PostgreSQL 18"), version
            assert conn.execute("SHOW listen_addresses").fetchall() == [("127.0.0.1",)]
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        assert pg.child is not None
        backends = procs.children_of(pg.child.pid)
        assert backends  # checkpointer, walwriter, ...
    finally:
        pg.stop()
    first_port = pg.port
    assert not pg.child.alive
    assert procs.group_members(pg.child.pid) == []
    assert all(gone(pid) for pid in backends)
    assert postgres_pids_for(pg.pgdata) == []

    pg = EmbeddedPostgres(pg_dir).start()
    try:
        assert pg.port == first_port  # remembered, and still free
        with psycopg.connect(libpq_url(pg.url)) as conn:
            assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]
    finally:
        pg.stop()
    assert postgres_pids_for(pg.pgdata) == []


def test_embedded_postgres_dies_with_sigkilled_parent(pg_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ballast.pg import EmbeddedPostgres
        pg = EmbeddedPostgres(Path({str(pg_dir)!r})).start()
        print(pg.child.pid, flush=True)
        time.sleep(1000)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    assert parent.stdout is not None
    try:
        postmaster = int(parent.stdout.readline())
        assert postgres_pids_for(pg_dir / "pg") == [postmaster]
        backends = procs.children_of(postmaster)  # each its own session: not in the group
        assert backends
        parent.kill()
        parent.wait()
        everything = [postmaster, *backends]
        procs.wait_until(lambda: all(gone(pid) for pid in everything), 15, "postgres to shut down")
    finally:
        parent.kill()
        parent.wait()
        for pid in postgres_pids_for(pg_dir / "pg"):
            os.kill(pid, signal.SIGKILL)


# --- database helpers ------------------------------------------------------------------


def test_url_forms() -> None:
    plain = "postgresql://postgres:s3cret@db.example:5433/app?sslmode=disable"
    alchemy = "postgresql+psycopg://postgres:s3cret@db.example:5433/app?sslmode=disable"
    assert sqlalchemy_url(plain) == alchemy
    assert sqlalchemy_url(alchemy) == alchemy
    assert libpq_url(alchemy) == plain
    assert libpq_url(plain) == plain
    assert libpq_url("postgres://u@h/d") == "postgresql://u@h/d"
    with pytest.raises(ValueError):
        libpq_url("mysql://u@h/d")


def test_create_and_drop_database() -> None:
    name = f"ballast_infra_{uuid.uuid4().hex[:8]}"
    url = create_database(DATABASE_URL, name)
    try:
        assert url.endswith(f"/{name}")
        with psycopg.connect(libpq_url(url)) as conn:
            assert conn.execute("SELECT current_database()").fetchall() == [(name,)]
        # A session still open on the database must not stop the drop.
        lingering = psycopg.connect(libpq_url(sqlalchemy_url(url)))
    finally:
        drop_database(sqlalchemy_url(DATABASE_URL), name)
    lingering.close()
    with psycopg.connect(libpq_url(DATABASE_URL)) as conn:
        assert conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None
    drop_database(DATABASE_URL, name)  # absent: no error
