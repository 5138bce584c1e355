"""The FastAPI app in process (httpx's ASGI transport, no sockets, no lifespan), wired by
hand: the real journal on the test database and a real object store under tmp_path;
Temporal is real only for the tests that ask for it."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.deps import Services
from api.engines import EngineDirectory
from ballast.settings import Settings
from journal.objects import ObjectStore

UPLOAD_LIMIT = 64 * 1024
REQUEST_LIMIT = 16 * 1024


class Untouchable:
    """Stands in for a service that a request must not reach."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        raise AssertionError(f"the request reached {self._name}.{attr}")


@pytest.fixture
def settings(tmp_path) -> Settings:
    # A control queue no worker polls: batches created here stay where the test puts them.
    return Settings(data_dir=tmp_path, served_model_name="ballast-tiny", max_upload_bytes=UPLOAD_LIMIT,
                    max_request_bytes=REQUEST_LIMIT, control_queue=f"api-test-{uuid.uuid4().hex[:8]}")


def build(settings: Settings, db, temporal) -> httpx.AsyncClient:
    app = create_app(settings, temporal=temporal)
    engines: Any = EngineDirectory(db) if not isinstance(db, Untouchable) else db  # or a stand-in
    app.state.services = Services(settings, db, temporal, ObjectStore(settings.object_store_url), engines,
                                  httpx.AsyncClient())
    # raise_app_exceptions: an error that escapes every handler fails the test loudly.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ballast.test")


@pytest.fixture
async def api(settings, db):
    """Real Postgres; Temporal must not be reached."""
    async with build(settings, db, Untouchable("temporal")) as client:
        yield client


@pytest.fixture
async def bare_api(settings):
    """Neither Postgres nor Temporal may be reached: input refused at the edge."""
    async with build(settings, Untouchable("postgres"), Untouchable("temporal")) as client:
        yield client


@pytest.fixture(scope="session")
async def temporal_client(temporal_address):
    from temporalio.client import Client

    return await Client.connect(temporal_address)


@pytest.fixture
async def temporal_api(settings, db, temporal_client):
    async with build(settings, db, temporal_client) as client:
        yield client


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
