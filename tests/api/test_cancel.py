"""Cancel at any point ends in one consistent final status, every item exactly once in the
output or the error file, and a 2xx or 4xx answer.

In process: the API on real Postgres and a real Temporal dev server, with no control
worker polling the batch's task queue, so the test plays the workflow: it runs the
control activities itself, in the order a run would, with the cancel landing between
any two of them."""

from __future__ import annotations

import io
import json

import pytest
from temporalio.testing import ActivityEnvironment

from activities.batch import BatchActivities
from journal import batch_store
from journal.leases import acquire
from protocol import keys
from protocol.requests import RequestLimits
from protocol.temporal import BatchOutcome, FinalizeInput, ValidateInput
from storage.objects import ObjectStore
from tests.api.conftest import assert_openai_error

N = 3
CUSTOM_IDS = [f"c{i}" for i in range(N)]


@pytest.fixture
def acts(settings, services_db):
    """The control worker's batch activities."""
    return BatchActivities(services_db, ObjectStore(settings.object_store_url), RequestLimits("ballast-tiny", 1024),
                           100)


async def _create(api) -> str:
    lines = [dict(custom_id=c, method="POST", url="/v1/chat/completions",
                  body=dict(model="ballast-tiny", messages=[dict(role="user", content="hi")], max_tokens=2))
             for c in CUSTOM_IDS]
    data = "".join(json.dumps(ln) + "\n" for ln in lines).encode()
    f = await api.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
    r = await api.post("/v1/batches", json=dict(input_file_id=f.json()["id"], endpoint="/v1/chat/completions",
                                                completion_window="24h"))
    assert r.status_code == 200 and r.json()["status"] == "validating", r.text
    return r.json()["id"]


async def _validate(acts, batch_id: str) -> None:
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(batch_id))


async def _finalize(acts, batch_id: str, outcome: BatchOutcome) -> str:
    return await ActivityEnvironment().run(acts.finalize_batch, FinalizeInput(batch_id, outcome, 1.0))


async def _settle(db, batch_id: str, idx: int, ok: bool = True) -> None:
    """An item's result, as the engine worker that ran it journals it."""
    body = {"object": "chat.completion"} if ok else {"error": {"message": "no", "code": "x"}}
    async with db.begin() as conn:
        fence = await acquire(conn, keys.item(batch_id, idx), "test")
    ev = (batch_store.item_completed_event(batch_id, idx, "default", body, fence=fence) if ok
          else batch_store.item_failed_event(batch_id, idx, "default", 400, body, fence=fence))
    async with db.begin() as conn:
        await batch_store.append_one(conn, ev)


async def _cancel(api, batch_id: str, status: str) -> dict:
    r = await api.post(f"/v1/batches/{batch_id}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == status and r.json()["cancelling_at"]
    return r.json()


async def _refused(api, batch_id: str, status: str) -> None:
    err = assert_openai_error(await api.post(f"/v1/batches/{batch_id}/cancel"), 400, code="invalid_state")
    assert err["message"] == f"Cannot cancel a batch with status {status}."


async def _results(api, batch: dict) -> tuple[dict, dict]:
    """custom_id → line, of the output and of the error file; each id at most once."""
    out = {}
    for key in ("output_file_id", "error_file_id"):
        lines = []
        if batch[key]:
            r = await api.get(f"/v1/files/{batch[key]}/content")
            lines = [json.loads(ln) for ln in r.text.splitlines()]
        out[key] = {ln["custom_id"]: ln for ln in lines}
        assert len(out[key]) == len(lines)
    return out["output_file_id"], out["error_file_id"]


async def _final(api, batch_id: str) -> dict:
    return (await api.get(f"/v1/batches/{batch_id}")).json()


async def test_cancelled_before_validation_twice_and_after_the_workflow_closed(temporal_api, temporal_client, acts):
    api = temporal_api
    batch_id = await _create(api)
    await _cancel(api, batch_id, "cancelling")
    await _cancel(api, batch_id, "cancelling")  # idempotent: re-signals
    await temporal_client.get_workflow_handle(keys.batch(batch_id)).terminate("test: the workflow is gone")
    await _cancel(api, batch_id, "cancelling")  # a signal to a closed workflow is no error

    await _validate(acts, batch_id)  # the file is good, but the batch stays cancelling
    assert (await _final(api, batch_id))["status"] == "cancelling"
    assert await _finalize(acts, batch_id, "cancelled") == "cancelled"

    batch = await _final(api, batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"]
    out, err = await _results(api, batch)
    assert not out and list(err) == CUSTOM_IDS
    assert all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in err.values())
    await _refused(api, batch_id, "cancelled")


async def test_a_cancel_after_every_item_finished_ends_cancelled_with_them_all_in_the_output(temporal_api, acts, db,
                                                                                            services_db):
    api = temporal_api
    batch_id = await _create(api)
    await _validate(acts, batch_id)
    for i in range(N):
        await _settle(services_db, batch_id, i)
    await _cancel(api, batch_id, "cancelling")
    # The workflow's run saw every item done: it asks for `completed`.
    assert await _finalize(acts, batch_id, "completed") == "cancelled"

    batch = await _final(api, batch_id)
    assert batch["status"] == "cancelled" and batch["request_counts"]["completed"] == N
    out, err = await _results(api, batch)
    assert list(out) == CUSTOM_IDS and not err and batch["error_file_id"] is None
    await _refused(api, batch_id, "cancelled")


async def test_a_cancel_mid_run_puts_each_item_once_in_output_or_error(temporal_api, acts, db, services_db):
    api = temporal_api
    batch_id = await _create(api)
    await _validate(acts, batch_id)
    await _settle(services_db, batch_id, 0)
    await _settle(services_db, batch_id, 1, ok=False)
    await _cancel(api, batch_id, "cancelling")
    await _cancel(api, batch_id, "cancelling")
    assert await _finalize(acts, batch_id, "cancelled") == "cancelled"
    assert await _finalize(acts, batch_id, "cancelled") == "cancelled"  # a retry changes nothing

    batch = await _final(api, batch_id)
    out, err = await _results(api, batch)
    assert list(out) == ["c0"] and list(err) == ["c1", "c2"]
    assert err["c1"]["response"]["status_code"] == 400 and err["c2"]["error"]["code"] == "batch_cancelled"


async def test_a_cancel_during_finalization_or_after_completion_is_refused(temporal_api, acts, db, services_db):
    api = temporal_api
    batch_id = await _create(api)
    await _validate(acts, batch_id)
    for i in range(N):
        await _settle(services_db, batch_id, i)
    # What finalize does first; the files are being written now.
    async with db.begin() as conn:
        assert await batch_store.move_status(conn, batch_id, "finalizing", 1.0)
    await _refused(api, batch_id, "finalizing")
    assert await _finalize(acts, batch_id, "completed") == "completed"
    await _refused(api, batch_id, "completed")

    batch = await _final(api, batch_id)
    assert batch["status"] == "completed" and batch["finalizing_at"] and batch["completed_at"]
    out, err = await _results(api, batch)
    assert list(out) == CUSTOM_IDS and not err


async def test_an_expired_batch_is_finalizing_first_so_no_cancel_strands_it(temporal_api, acts, db, services_db):
    api = temporal_api
    batch_id = await _create(api)
    await _validate(acts, batch_id)
    await _settle(services_db, batch_id, 2)
    assert await _finalize(acts, batch_id, "expired") == "expired"
    await _refused(api, batch_id, "expired")

    batch = await _final(api, batch_id)
    assert batch["status"] == "expired" and batch["finalizing_at"] and batch["expired_at"]
    out, err = await _results(api, batch)
    assert list(out) == ["c2"] and list(err) == ["c0", "c1"]
    assert all(e["error"]["code"] == "batch_expired" for e in err.values())
