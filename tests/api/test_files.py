"""What a tenant keeps in the file store is bounded and its own: GET /v1/files lists only its
live files (newest first, paged by `after`, by purpose); DELETE /v1/files/{id} removes the
record and the object, but never a file an open batch or an unfinished fine-tuning job
still reads (409 file_in_use); files may expire (`expires_after`, a batch's
`output_expires_after`), are then answered as deleted, and the sweep removes them; uploads
past the tenant's file count or bytes are refused with nothing written, also when they
race; file names are capped. Checked with OpenAI's own client where it speaks the call."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid

import openai
import pytest
from sqlalchemy import select
from temporalio.testing import ActivityEnvironment

from activities.batch import BatchActivities
from journal import batch_store, finetune_store
from journal.events import append, rebuild
from journal.schema import files
from protocol import keys
from protocol.requests import RequestLimits
from protocol.temporal import FinalizeInput, ValidateInput
from storage.objects import ObjectStore
from tests.api.conftest import Untouchable, assert_openai_error, build, new_key

LINE = (json.dumps(dict(custom_id="c0", method="POST", url="/v1/chat/completions",
                        body=dict(model="ballast-tiny", messages=[dict(role="user", content="hi")], max_tokens=2)))
        + "\n").encode()


@pytest.fixture
def tenant() -> str:
    return "files-" + uuid.uuid4().hex[:8]


@pytest.fixture
async def http(settings, db, tenant):
    """A tenant of its own; Temporal must not be reached."""
    async with build(settings, db, Untouchable("temporal"), await new_key(db, tenant)) as client:
        client.tenant = tenant
        yield client


@pytest.fixture
async def client(http):
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=http.headers["Authorization"][7:],
                                  max_retries=0, http_client=http) as c:
        yield c


async def limited(settings, db, **limits):
    """A client of a new tenant (`.tenant`), on an app with these storage limits."""
    tenant = "q-" + uuid.uuid4().hex[:8]
    client = build(settings.model_copy(update=limits), db, Untouchable("temporal"), await new_key(db, tenant))
    client.tenant = tenant
    return client


async def upload(http, data: bytes = LINE, name: str = "in.jsonl", purpose: str = "batch", **fields):
    return await http.post("/v1/files", files={"file": (name, io.BytesIO(data))}, data={"purpose": purpose, **fields})


async def rows_of(db, tenant: str) -> list[dict]:
    async with db.connect() as conn:
        return [dict(r._mapping) for r in (await conn.execute(select(files).where(files.c.tenant == tenant))).all()]


def objects(settings) -> set[str]:
    root = settings.data_dir / "objects" / "files"
    return {p.name for p in root.iterdir() if p.is_file()} if root.exists() else set()


# -- list ---------------------------------------------------------------------------


async def test_the_list_is_the_tenants_newest_first_paged_and_by_purpose(client, http, other_api):
    made = [await client.files.create(file=(f"f{i}.jsonl", io.BytesIO(LINE)), purpose="batch") for i in range(4)]
    tune = await client.files.create(file=("t.jsonl", io.BytesIO(LINE)), purpose="fine-tune")
    theirs = (await upload(other_api)).json()["id"]
    newest_first = [tune.id, *[f.id for f in made[::-1]]]

    page = await client.files.list()
    assert [f.id for f in page.data] == newest_first and not page.has_more
    assert page.data[0] == tune  # the same object as the upload answered: OpenAI's own type
    assert [f.id for f in (await client.files.list(order="asc")).data] == newest_first[::-1]
    assert [f.id for f in (await client.files.list(purpose="batch")).data] == newest_first[1:]
    assert [f.id for f in (await client.files.list(purpose="fine-tune")).data] == [tune.id]
    assert (await client.files.list(purpose="assistants")).data == []

    # Pages of two, followed by the client itself (after = the last id), each way.
    first = await client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    assert [f.id async for f in client.files.list(limit=2)] == newest_first
    assert [f.id async for f in client.files.list(limit=2, order="asc")] == newest_first[::-1]
    raw = (await http.get("/v1/files", params=dict(limit=2))).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == (
        "list", newest_first[0], newest_first[1], True)

    # Another tenant's file is never listed, and its id as a cursor pages like an unknown one.
    assert theirs not in [f.id for f in page.data]
    assert [f["id"] for f in (await other_api.get("/v1/files")).json()["data"]] == [theirs]
    assert (await client.files.list(after=theirs)).data == []
    assert (await client.files.list(after="file-" + "0" * 24)).data == []
    assert (await http.get("/v1/files", params=dict(after="not an id"))).json()["data"] == []


async def test_a_deleted_cursor_still_places_the_next_page(client):
    made = [(await client.files.create(file=("f.jsonl", io.BytesIO(LINE)), purpose="batch")).id for _ in range(4)]
    newest_first = made[::-1]
    first = await client.files.list(limit=2)
    for f in first.data:  # a client deleting what it lists, as it lists
        await client.files.delete(f.id)
    assert [f.id for f in (await client.files.list(limit=2, after=first.data[-1].id)).data] == newest_first[2:]


async def test_bad_list_parameters_are_400(http):
    for params, param in ((dict(limit=0), "limit"), (dict(limit=10_001), "limit"), (dict(order="up"), "order"),
                          (dict(purpose="a\x00b"), "purpose"), (dict(purpose="pictures"), "purpose")):
        assert_openai_error(await http.get("/v1/files", params=params), 400, param)


# -- delete -------------------------------------------------------------------------


async def test_delete_removes_the_row_and_the_object_and_is_404_after(client, http, db, settings, tenant):
    f = await client.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    assert f.id in objects(settings)
    deleted = await client.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    assert await rows_of(db, tenant) == [] and f.id not in objects(settings)
    for call in (client.files.retrieve(f.id), client.files.content(f.id), client.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            await call
        assert caught.value.code == "not_found"
    assert (await client.files.list()).data == []
    assert_openai_error(await http.get(f"/v1/files/{f.id}/content"), 404, "file_id", "not_found")


async def test_another_tenants_file_cannot_be_deleted(http, other_api, db, settings):
    theirs = (await upload(other_api)).json()["id"]
    missing = "file-" + uuid.uuid4().hex[:24]
    mine = assert_openai_error(await http.delete(f"/v1/files/{theirs}"), 404, "file_id", "not_found")
    unknown = assert_openai_error(await http.delete(f"/v1/files/{missing}"), 404, "file_id", "not_found")
    assert mine["message"].split("'")[0] == unknown["message"].split("'")[0]
    assert_openai_error(await http.delete("/v1/files/no%20such"), 404, "file_id", "not_found")
    assert (await other_api.get(f"/v1/files/{theirs}")).status_code == 200 and theirs in objects(settings)


async def test_a_file_an_open_batch_reads_is_refused_until_the_batch_ends(http, db, settings, tenant):
    fid = (await upload(http)).json()["id"]
    bid = "batch_" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=bid, tenant=tenant, endpoint="/v1/chat/completions",
                                                  input_file_id=fid, completion_window="24h", metadata=None,
                                                  status="validating", created_at=0, expires_at=1))
    for status in ("validating", "in_progress", "finalizing"):
        if status != "validating":
            async with db.begin() as conn:
                assert await batch_store.move_status(conn, bid, status, time.time())
        r = await http.delete(f"/v1/files/{fid}")
        err = assert_openai_error(r, 409, "file_id", "file_in_use")
        assert bid in err["message"] and status in err["message"]
        assert r.headers["x-should-retry"] == "false"
        assert len(await rows_of(db, tenant)) == 1 and fid in objects(settings)
        assert (await http.get(f"/v1/files/{fid}/content")).content == LINE
    async with db.begin() as conn:
        assert await batch_store.move_status(conn, bid, "completed", time.time())
    assert (await http.delete(f"/v1/files/{fid}")).json() == dict(id=fid, object="file", deleted=True)
    assert await rows_of(db, tenant) == [] and fid not in objects(settings)


async def test_a_file_an_unfinished_fine_tuning_job_reads_is_refused(http, db, settings, tenant):
    training, validation = [(await upload(http, purpose="fine-tune")).json()["id"] for _ in range(2)]
    job = "ftjob-" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await append(conn, [finetune_store.created_event(dict(
            id=job, tenant=tenant, model="ballast-tiny", training_file=training, validation_file=validation,
            hyperparameters={}, seed=0, suffix=None, metadata=None, status="running", created_at=0))])
    for fid in (training, validation):
        err = assert_openai_error(await http.delete(f"/v1/files/{fid}"), 409, "file_id", "file_in_use")
        assert job in err["message"]
    assert len(await rows_of(db, tenant)) == 2
    async with db.begin() as conn:
        await append(conn, [finetune_store.status_event(job, tenant, "succeeded", 0)])
    for fid in (training, validation):
        assert (await http.delete(f"/v1/files/{fid}")).status_code == 200
    assert await rows_of(db, tenant) == [] and not {training, validation} & objects(settings)


async def test_a_delete_racing_a_batch_create_never_strands_the_batch(temporal_api, db):
    """The batch holds its file while it is created: either the delete wins (the batch is a
    404) or the batch does (the delete is a 409), never a batch without its input."""
    for _ in range(5):
        fid = (await upload(temporal_api)).json()["id"]
        made, gone = await asyncio.gather(
            temporal_api.post("/v1/batches", json=dict(input_file_id=fid, endpoint="/v1/chat/completions",
                                                       completion_window="24h")),
            temporal_api.delete(f"/v1/files/{fid}"))
        assert sorted((made.status_code, gone.status_code)) in ([200, 409], [200, 404]), (made.text, gone.text)
        if made.status_code == 200:
            assert gone.status_code == 409
            async with db.connect() as conn:
                assert await batch_store.get_file(conn, fid, "default") is not None
        else:
            assert_openai_error(made, 404, "input_file_id", "not_found")


# -- expiry -------------------------------------------------------------------------


async def test_expires_after_is_stored_and_answered(client, db, tenant):
    before = int(time.time())
    f = await client.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600 and f.created_at >= before
    assert (await client.files.retrieve(f.id)).expires_at == f.expires_at
    assert [x.expires_at for x in (await client.files.list()).data] == [f.expires_at]
    [row] = await rows_of(db, tenant)
    assert row["expires_at"] == f.expires_at
    forever = await client.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    assert forever.expires_at is None


@pytest.mark.parametrize("fields, param", [
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after[seconds]"),
])
async def test_a_bad_expires_after_is_400_naming_it_and_keeps_nothing(http, db, settings, tenant, fields, param):
    assert_openai_error(await upload(http, **fields), 400, param)
    assert await rows_of(db, tenant) == [] and objects(settings) == set()


async def _expired(db, store: ObjectStore, tenant: str, at: int = 1) -> str:
    """A file of `tenant` that expired at `at`, journaled as an upload would be."""
    fid = "file-" + uuid.uuid4().hex[:24]
    with store.writer(keys.file(fid)) as out:
        out.write(LINE)
    async with db.begin() as conn:
        await batch_store.create_file(conn, dict(id=fid, tenant=tenant, purpose="batch", filename="old.jsonl",
                                                 bytes=len(LINE), object_key=keys.file(fid), created_at=0), at)
    return fid


async def test_an_expired_file_is_answered_as_deleted_and_the_sweep_removes_it(http, db, settings, tenant):
    store = http.services.store
    fid = await _expired(db, store, tenant)
    live = (await upload(http)).json()["id"]
    for path in (f"/v1/files/{fid}", f"/v1/files/{fid}/content"):
        assert_openai_error(await http.get(path), 404, "file_id", "not_found")
    assert_openai_error(await http.delete(f"/v1/files/{fid}"), 404, "file_id", "not_found")
    assert [f["id"] for f in (await http.get("/v1/files")).json()["data"]] == [live]
    assert len(await rows_of(db, tenant)) == 2 and fid in objects(settings)  # until the sweep

    assert await batch_store.sweep_expired_files(db, store) >= 1
    assert [r["id"] for r in await rows_of(db, tenant)] == [live]
    assert objects(settings) == {live}
    assert await batch_store.sweep_expired_files(db, store) == 0  # idempotent: nothing left to do
    # A missing object is no obstacle: the row still goes.
    gone = await _expired(db, store, tenant)
    (settings.data_dir / "objects" / "files" / gone).unlink()
    assert await batch_store.sweep_expired_files(db, store) >= 1 and [r["id"] for r in await rows_of(db, tenant)] == [
        live]


async def test_the_sweep_spares_an_expired_file_an_open_batch_reads_and_pages(http, db, settings, tenant):
    store = http.services.store
    held = await _expired(db, store, tenant)
    bid = "batch_" + uuid.uuid4().hex[:24]
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=bid, tenant=tenant, endpoint="/v1/chat/completions",
                                                  input_file_id=held, completion_window="24h", metadata=None,
                                                  status="validating", created_at=0, expires_at=1))
    loose = [await _expired(db, store, tenant) for _ in range(5)]
    assert await batch_store.sweep_expired_files(db, store, page=2) >= 5  # pages of two, to the end
    assert [r["id"] for r in await rows_of(db, tenant)] == [held] and objects(settings) == {held}
    assert not set(loose) & objects(settings)
    async with db.connect() as conn:  # the batch still reads it, as validation would
        assert (await batch_store.get_file(conn, held, tenant))["id"] == held
    async with db.begin() as conn:
        assert await batch_store.move_status(conn, bid, "failed", time.time())
    assert await batch_store.sweep_expired_files(db, store) >= 1
    assert await rows_of(db, tenant) == [] and objects(settings) == set()


async def test_expire_files_returns_the_keys_of_the_rows_it_deleted(db, http, tenant):
    fid = await _expired(db, http.services.store, tenant)
    async with db.begin() as conn:
        object_keys = await batch_store.expire_files(conn, time.time(), limit=10_000)
    assert keys.file(fid) in object_keys and await rows_of(db, tenant) == []
    async with db.begin() as conn:
        assert keys.file(fid) not in await batch_store.expire_files(conn, time.time())
    http.services.store.delete(object_keys)
    http.services.store.delete(object_keys)  # again: already gone is fine


async def test_output_expires_after_reaches_the_batchs_files(temporal_api, settings, db, services_db):
    async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=temporal_api.headers["Authorization"][7:],
                                  max_retries=0, http_client=temporal_api) as client:
        f = await client.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h",
                                            output_expires_after={"anchor": "created_at", "seconds": 7200})
        async with db.connect() as conn:
            assert await batch_store.output_expiry(conn, batch.id) == 7200
        # The input is still needed while the batch runs.
        with pytest.raises(openai.ConflictError) as caught:
            await client.files.delete(f.id)
        assert caught.value.code == "file_in_use"
        acts = BatchActivities(services_db, ObjectStore(settings.object_store_url),
                               RequestLimits("ballast-tiny", 1024), 100)
        await ActivityEnvironment().run(acts.validate_batch, ValidateInput(batch.id))
        assert await ActivityEnvironment().run(acts.finalize_batch, FinalizeInput(batch.id, "cancelled", 1.0)) == \
            "cancelled"
        done = await client.batches.retrieve(batch.id)
        errors = await client.files.retrieve(done.error_file_id)
        assert errors.purpose == "batch_output" and errors.expires_at == errors.created_at + 7200
        assert (await client.files.delete(f.id)).deleted  # the batch has ended: its input may go


@pytest.mark.parametrize("policy, param", [
    (dict(anchor="created_at", seconds=60), "output_expires_after.seconds"),
    (dict(anchor="created_at", seconds=2_592_001), "output_expires_after.seconds"),
    (dict(anchor="now", seconds=3600), "output_expires_after.anchor"),
    (dict(seconds=3600), "output_expires_after.anchor"),
])
async def test_a_bad_output_expires_after_is_400_naming_it(api, policy, param):
    r = await api.post("/v1/batches", json=dict(input_file_id="file-abc", endpoint="/v1/chat/completions",
                                                completion_window="24h", output_expires_after=policy))
    assert_openai_error(r, 400, param)


async def test_the_read_models_rebuild_with_expiry_and_deletion(http, db, owner_db, tenant):
    kept = (await upload(http, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "86400"})).json()
    dropped = (await upload(http)).json()["id"]
    assert (await http.delete(f"/v1/files/{dropped}")).status_code == 200
    before = await rows_of(db, tenant)
    assert [(r["id"], r["expires_at"]) for r in before] == [(kept["id"], kept["expires_at"])]
    async with owner_db.begin() as conn:
        await rebuild(conn)
    assert await rows_of(db, tenant) == before


# -- quota --------------------------------------------------------------------------


async def test_past_the_file_count_uploads_are_refused_and_nothing_is_written(settings, db):
    async with await limited(settings, db, max_files_per_tenant=3) as http:
        ids = [(await upload(http)).json()["id"] for _ in range(3)]
        kept = objects(settings)
        r = await upload(http)
        err = assert_openai_error(r, 409, "file", "file_count_limit_exceeded")
        assert "3 files" in err["message"] and "DELETE /v1/files" in err["message"]
        assert r.headers["x-should-retry"] == "false"
        assert objects(settings) == kept
        assert len((await http.get("/v1/files")).json()["data"]) == 3
        assert (await http.delete(f"/v1/files/{ids[0]}")).status_code == 200
        assert (await upload(http)).status_code == 200  # room again


async def test_past_the_tenants_bytes_uploads_are_refused_and_nothing_is_written(settings, db):
    async with await limited(settings, db, max_file_bytes_per_tenant=100) as http:
        assert (await upload(http, b"x" * 60)).status_code == 200
        kept = objects(settings)
        r = await upload(http, b"x" * 50)
        err = assert_openai_error(r, 413, "file", "file_storage_limit_exceeded")
        assert r.headers["x-should-retry"] == "false"
        assert "100 bytes" in err["message"] and "DELETE /v1/files" in err["message"]
        assert objects(settings) == kept and len((await http.get("/v1/files")).json()["data"]) == 1
        assert (await upload(http, b"x" * 40)).status_code == 200  # exactly the limit
        # Full: even one byte is refused, and its object removed.
        assert_openai_error(await upload(http, b"x"), 413, "file", "file_storage_limit_exceeded")
        assert len(objects(settings)) == 2


async def test_an_expired_file_no_longer_counts(settings, db):
    async with await limited(settings, db, max_files_per_tenant=1) as http:
        await _expired(db, http.services.store, http.tenant)  # expired, not yet swept: takes no room
        kept = (await upload(http)).json()["id"]
        assert_openai_error(await upload(http), 409, "file", "file_count_limit_exceeded")
        assert (await http.delete(f"/v1/files/{kept}")).status_code == 200
        assert (await upload(http)).status_code == 200


@pytest.mark.parametrize("limits, sizes, allowed", [
    (dict(max_files_per_tenant=3), [10] * 8, 3),
    (dict(max_file_bytes_per_tenant=100), [30] * 8, 3),
])
async def test_concurrent_uploads_at_the_edge_take_exactly_the_room_there_is(settings, db, limits, sizes, allowed):
    async with await limited(settings, db, **limits) as http:
        answers = await asyncio.gather(*(upload(http, b"x" * n) for n in sizes))
        ok = [r.json()["id"] for r in answers if r.status_code == 200]
        assert len(ok) == allowed, [r.text for r in answers]
        for r in answers:
            if r.status_code != 200:
                assert r.status_code in (409, 413) and r.json()["error"]["code"].endswith("_limit_exceeded")
        assert objects(settings) == set(ok)  # no refused upload left its object
        assert sorted(r["id"] for r in await rows_of(db, http.tenant)) == sorted(ok)


# -- file names ---------------------------------------------------------------------


async def test_a_file_name_past_255_characters_is_400(http, db, settings, tenant):
    assert (await upload(http, name="n" * 249 + ".jsonl")).json()["filename"] == "n" * 249 + ".jsonl"
    err = assert_openai_error(await upload(http, name="n" * 250 + ".jsonl"), 400, "file", "invalid_value")
    assert "256" in err["message"] and "255" in err["message"]
    assert len(await rows_of(db, tenant)) == 1 and len(objects(settings)) == 1


async def test_the_control_workers_quota_tick_sweeps_expired_files(http, db, services_db, settings, tenant):
    """Wired where it runs: the quota reconciler's activity starts the sweep in the background."""
    from temporalio.testing import ActivityEnvironment

    from activities.quota import QuotaActivities
    from protocol.temporal import ReconcileInput

    store = http.services.store
    fid = await _expired(db, store, tenant)
    quota = QuotaActivities(services_db, store=store)
    await ActivityEnvironment().run(quota.reconcile_quota, ReconcileInput(holder_ttl_s=30))
    assert quota._files is not None
    await quota._files
    assert fid not in {r["id"] for r in await rows_of(db, tenant)} and fid not in objects(settings)
