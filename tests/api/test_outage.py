"""Postgres unreachable (restarting, the network): requests that need it answer 503 with
`Retry-After` in the OpenAI error shape, never a 500 or a hang; health says which part is
down. Over a real connection pool pointed at a port nothing listens on."""

from __future__ import annotations

from ballast import procs
from journal.db import connect
from journal.tenant_store import Principal
from tests.api.conftest import BARE_KEY, Untouchable, assert_openai_error, build, known_keys


async def test_an_unreachable_database_is_a_503_with_retry_after(settings):
    down = connect(f"postgresql://postgres@127.0.0.1:{procs.free_port()}/ballast", pool_size=1)
    try:
        # A key the database must check: the check itself says unavailable.
        key = "sk-ballast-" + "a-key-to-look-up".ljust(43, "0")
        async with build(settings, down, Untouchable("temporal"), key) as api:
            r = await api.get("/v1/batches")
            assert_openai_error(r, 503, code="unavailable")
            assert r.headers["retry-after"]
            health = await api.get("/healthz")  # the key cannot be checked: what anyone gets
            assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        # A key already known (cached): the route's own queries meet the outage.
        known = known_keys({BARE_KEY: Principal("default", "key_bare")})
        async with build(settings, down, Untouchable("temporal"), BARE_KEY, keys=known) as api:
            for path in ("/v1/batches", "/v1/batches/batch_abc", "/v1/files/file-abc"):
                r = await api.get(path)
                err = assert_openai_error(r, 503, code="unavailable")
                assert r.headers["retry-after"] == "5" and "database" in err["message"], (path, err)
        # An admin's key (known, cached) sees which part is down, and why.
        admin = known_keys({BARE_KEY: Principal("default", "key_bare", admin=True)})
        async with build(settings, down, Untouchable("temporal"), BARE_KEY, keys=admin) as api:
            health = (await api.get("/healthz")).json()
            assert health["parts"]["postgres"].startswith("down: ") and len(health["parts"]["postgres"]) > 6
    finally:
        await down.dispose()


async def test_an_upload_the_file_store_cannot_take_is_a_503_and_keeps_nothing(settings):
    # The store's `files` directory is a plain file: every write under it fails, as on a
    # store that is full or read-only, with the operating system's own error.
    objects = settings.data_dir / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    (objects / "files").write_text("not a directory")
    known = known_keys({BARE_KEY: Principal("default", "key_bare")})
    async with build(settings, Untouchable("postgres"), Untouchable("temporal"), BARE_KEY, keys=known) as api:
        r = await api.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a"}\n')},
                           data={"purpose": "batch"})
        err = assert_openai_error(r, 503, code="storage_unavailable")
        assert r.headers["retry-after"] == "30" and "(File exists)" in err["message"], err
    assert [p.name for p in objects.iterdir()] == ["files"]  # no object, no temporary left behind
