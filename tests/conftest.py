"""Shared fixtures: a fresh Postgres database per test run (dropped afterwards).

`DATABASE_URL` points at a server (CI: the machine's Postgres); without it an embedded
server is started under a temporary directory.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from ballast import pg
from journal.db import connect
from journal.migrate import upgrade


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory):
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    server = pg.EmbeddedPostgres(Path(tmp_path_factory.mktemp("pg")))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def db_url(pg_server_url):
    name = f"ballast_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = pg.create_database(pg_server_url, name)
    upgrade(url)
    try:
        yield url
    finally:
        pg.drop_database(pg_server_url, name)


@pytest.fixture(scope="session")
async def db(db_url):
    engine = connect(db_url)
    try:
        yield engine
    finally:
        await engine.dispose()
