"""Shared fixtures: a fresh Postgres database per test run (dropped afterwards).

`DATABASE_URL` points at a server (CI: the machine's Postgres); without it an embedded
server is started under a temporary directory, where every role needs its password (the
services' role's is made for the run, in BALLAST_SERVICE_DATABASE_PASSWORD). `db` connects as the services' restricted
role, as the API and workers do, so every test exercises its grants; `owner_db` is for
what only the owner may do (rebuilding read models, rewriting anything).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ballast import pg
from config import Settings
from config.database import SERVICE_ROLES, as_role
from journal.db import connect
from journal.migrate import upgrade


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory):
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    # Not under pytest's tmp dir: another pytest run resets its permissions, which the
    # server (running as an unprivileged user when we are root) needs to traverse.
    root = Path(tempfile.mkdtemp(prefix="ballast-test-pg-"))
    server = pg.EmbeddedPostgres(root)
    server.start()
    # The server asks every role for its password, the services' roles included: the
    # migrations (and migrated_database) set these on them, and Settings (so every process
    # a test starts, which inherits them) reads them, as BALLAST_SERVICE_DATABASE_PASSWORD
    # and BALLAST_{API,CONTROL,ENGINE}_DATABASE_PASSWORD.
    env = pytest.MonkeyPatch()
    for name in ("BALLAST_SERVICE_DATABASE_PASSWORD",
                 *(f"BALLAST_{kind.upper()}_DATABASE_PASSWORD" for kind in SERVICE_ROLES)):
        if not os.environ.get(name):
            env.setenv(name, secrets.token_urlsafe(24))
    try:
        yield server.url
    finally:
        env.undo()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def migrated_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new database on the server, migrated to head; its owner URL. Dropped afterwards."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = pg.create_database(server_url, name)
    migrate(url)
    try:
        yield url
    finally:
        pg.drop_database(server_url, name)


@pytest.fixture(scope="session")
def db_url(pg_server_url):
    """The test database, as its owner: what migrations use."""
    with migrated_database(pg_server_url, "ballast_test") as url:
        yield url


def migrate(owner_url: str) -> None:
    """Upgrade to head as the owner, and set each service role's password where one is set
    (the embedded server's; the machine's trusts them)."""
    upgrade(owner_url, service_url=service_url_for(owner_url))
    for role, password in Settings().role_passwords().items():
        pg.set_password(owner_url, role, password)


def role_url_for(owner_url: str, kind: str) -> str:
    """The database as service `kind`'s own role (config.database.SERVICE_ROLES)."""
    return as_role(owner_url, SERVICE_ROLES[kind], Settings().role_password(kind))


def service_url_for(owner_url: str) -> str:
    # Derived as the services derive theirs, so BALLAST_SERVICE_* settings apply alike.
    derived = Settings().model_copy(update=dict(database_url=owner_url, service_database_url=None))
    return derived.require("service_db_url")


@pytest.fixture(scope="session")
def service_db_url(db_url):
    """The test database, as the services' role (may only append to and read the journal)."""
    return service_url_for(db_url)


@asynccontextmanager
async def engine_at(url: str, **kw: Any) -> AsyncIterator[AsyncEngine]:
    engine = connect(url, **kw)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
async def services_db(service_db_url):
    """Every service's rights at once (ballast_service), for tests that run them in one process."""
    async with engine_at(service_db_url) as engine:
        yield engine


@pytest.fixture(scope="session")
def db(services_db):
    return services_db


@pytest.fixture(scope="session")
async def owner_db(db_url):
    async with engine_at(db_url, pool_size=2) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from engine.model_spec import ModelSpec
    from engine.tiny import TOOL_CALL_PARSER, build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("models"), max_model_len=1024)
    return ModelSpec(str(path), "ballast-tiny", 1024, TOOL_CALL_PARSER)


@pytest.fixture(scope="session")
async def engine(tiny_model):
    """One real vLLM engine over the tiny model for the whole session (start ~20 s)."""
    from engine.vllm_engine import Engine

    eng = await Engine.start(tiny_model, kv_cache_gib=0.5, max_num_seqs=64)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def temporal_address():
    from ballast.temporal_server import TemporalDevServer

    with TemporalDevServer(None) as server:
        yield server.address
        if out := os.environ.get("BALLAST_RECORD_HISTORIES"):  # the replay gate's material
            from tests.workflows.histories import record

            asyncio.run(record(server.address, Path(out)))


# `make test` runs the suite in two lanes (pytest-xdist, `-n 2 --dist loadscope`, each lane a
# scope of its own): it mostly waits on processes starting and on work crossing them, not on
# the cores. The second lane takes whole-stack runs that bring up stacks of their own; the
# first the rest, in collection order, the session's shared stack with it. Each lane has its
# own session fixtures (Temporal server, databases, engine); only Postgres is shared.
OWN_STACKS_LANE = frozenset({
    "test_chaos.py", "test_hosts.py", "test_supervise.py", "test_up.py", "test_pools.py", "test_placement.py",
    "test_pool_join.py", "test_preemption.py", "test_embeddings.py",
})


def lane(nodeid: str) -> str:
    folder, _, name = nodeid.split("::", 1)[0].rpartition("/")
    return "own-stacks" if folder == "tests/e2e" and name in OWN_STACKS_LANE else "shared"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)
