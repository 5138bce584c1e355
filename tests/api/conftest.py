"""The FastAPI app in process (httpx's ASGI transport, no sockets, no lifespan), wired by
hand: the real journal on the test database and a real object store under tmp_path;
Temporal is real only for the tests that ask for it.

Every client carries an API key: `api` and `temporal_api` one of tenant `default`, made in
the test database as the admin API makes them; `other_api` one of a tenant of its own.
`bare_api` has no database, so its one key is known to its key cache beforehand.

`db` here is the API's own role (ballast_api), as `ballast api` logs in: the app runs, and
each test sets its scene, with only what the API may do. `services_db` is for a scene the
API never makes itself (a batch's items, as the control worker journals them).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from api.app import create_app
from api.deps import Services
from api.services.auth import KeyCache
from api.services.engine_directory import EngineDirectory
from config import Settings
from journal import tenant_store
from journal.tenant_store import Principal
from storage.objects import ObjectStore
from tests.conftest import engine_at, role_url_for

UPLOAD_LIMIT = 64 * 1024
REQUEST_LIMIT = 16 * 1024


class Untouchable:
    """Stands in for a service that a request must not reach."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        raise AssertionError(f"the request reached {self._name}.{attr}")


@pytest.fixture(scope="session")
async def db(db_url):
    async with engine_at(role_url_for(db_url, "api"), name="ballast-api") as engine:
        yield engine


@pytest.fixture
def settings(tmp_path) -> Settings:
    # A control queue no worker polls: batches created here stay where the test puts them.
    return Settings(data_dir=tmp_path, served_model_name="ballast-tiny", max_upload_bytes=UPLOAD_LIMIT,
                    max_request_bytes=REQUEST_LIMIT, control_queue=f"api-test-{uuid.uuid4().hex[:8]}")


BARE_KEY = "sk-ballast-" + "bare-api-key-known-without-a-database".ljust(43, "0")


def known_keys(known: dict[str, Principal], ttl_s: float = 60.0) -> KeyCache:
    """A key cache that asks a dict, not Postgres."""

    async def lookup(plaintext: str) -> Principal | None:
        return known.get(plaintext)

    return KeyCache(lookup, ttl_s)


def build(settings: Settings, db, temporal, key: str | None = None, keys: KeyCache | None = None) -> httpx.AsyncClient:
    """The app on `db` (or a stand-in) and a client of it sending `key` (None: no key)."""
    app = create_app(settings, temporal=temporal)
    engines: Any = EngineDirectory(db) if not isinstance(db, Untouchable) else db  # or a stand-in
    keys = keys or (known_keys({BARE_KEY: Principal("default", "key_bare")}) if isinstance(db, Untouchable)
                    else KeyCache.over(db, settings.key_cache_s))
    app.state.services = Services(settings, db, temporal, ObjectStore(settings.object_store_url), engines,
                                  httpx.AsyncClient(), keys=keys)
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    # raise_app_exceptions: an error that escapes every handler fails the test loudly.
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ballast.test", headers=headers)
    client.services = app.state.services  # type: ignore[attr-defined]  # what a test may look into
    return client


async def new_key(db, tenant: str | None, *, admin: bool = False) -> str:
    """A key of `tenant` (created if new; None: an admin key of no tenant), made in the
    database as the admin API makes it."""
    async with db.begin() as conn:
        if tenant is not None:
            await tenant_store.ensure_tenant(conn, tenant)
        return (await tenant_store.create_key(conn, tenant, "tests", admin))[1]


@pytest.fixture(scope="session")
async def default_key(db) -> str:
    return await new_key(db, "default")


@pytest.fixture
async def api(settings, db, default_key):
    """Real Postgres; Temporal must not be reached. Tenant `default`."""
    async with build(settings, db, Untouchable("temporal"), default_key) as client:
        yield client


@contextlib.asynccontextmanager
async def tenant_api(settings, db, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    """As `api`, for a new tenant of its own (`client.tenant`, named `prefix-…`)."""
    tenant = f"{prefix}-{uuid.uuid4().hex[:8]}"
    async with build(settings, db, Untouchable("temporal"), await new_key(db, tenant)) as client:
        client.tenant = tenant  # type: ignore[attr-defined]
        yield client


@pytest.fixture
async def other_api(settings, db):
    """As `api`, for a tenant of its own (`other_api.tenant`), new in each test."""
    async with tenant_api(settings, db, "other") as client:
        yield client


@pytest.fixture
async def bare_api(settings):
    """Neither Postgres nor Temporal may be reached: input refused at the edge."""
    async with build(settings, Untouchable("postgres"), Untouchable("temporal"), BARE_KEY) as client:
        yield client


@pytest.fixture(scope="session")
async def temporal_client(temporal_address):
    from temporalio.client import Client

    return await Client.connect(temporal_address)


@pytest.fixture
async def temporal_api(settings, db, temporal_client, default_key):
    async with build(settings, db, temporal_client, default_key) as client:
        yield client


@pytest.fixture
async def owner(db_url):
    """The test database as its owner: what the services' roles may not do, done by hand."""
    async with engine_at(db_url) as engine:
        yield engine


@pytest.fixture
async def admin(settings, db):
    """The API with an admin key; Temporal must not be reached."""
    async with build(settings, db, Untouchable("temporal"), await new_key(db, None, admin=True)) as client:
        yield client


@pytest.fixture
async def client(temporal_api):
    """The official `openai` client over the API with a Temporal client (`temporal_api`)."""
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=temporal_api.headers["Authorization"][7:],
                                  max_retries=0, http_client=temporal_api) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


class Workflows:
    """Temporal, as far as the interactive path uses it: one start per window of requests
    that have ended, each with its outcome; `started` lists the requests."""

    def __init__(self):
        self.started = []
        self.windows = []

    async def start_workflow(self, run, window, **_):
        assert all(r.outcome is not None for r in window.requests), "started before the request ended"
        self.windows.append(window)
        self.started.extend(window.requests)
        return self

    @property
    def outcomes(self):
        return [r.outcome for r in self.started]
