"""Completion windows promised at creation and validation (policy/promises.py): a window the
pool's measured pace can meet behind what is promised already is accepted, with its promise
on the batch object and in `batch_promises`; one it cannot is refused, at creation where
the window is full already, at validation where the batch's own tokens overflow it, each
with OpenAI's error shape naming the shortest window that could be promised.

In process: the API on real Postgres and a real Temporal dev server; the pool is an engine
row this test announces, as an engine worker does, with the pace it says it measured (its
own model, so no other test's batches are promised there). The oracles are the schedules
worked out by hand below and the official `openai` client's reading.
"""

from __future__ import annotations

import io
import json
import uuid

import openai
import pytest
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.batch import BatchActivities
from config import Settings
from journal import engine_registry
from protocol.engine_wire import EngineStats
from protocol.requests import RequestLimits
from protocol.temporal import ValidateInput
from storage.objects import ObjectStore
from tests.api.conftest import REQUEST_LIMIT, UPLOAD_LIMIT

WINDOWS = ["1h", "4h", "24h"]
SHARE = 0.8
CONTEXT = 100_000


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, served_model_name="ballast-tiny", max_upload_bytes=UPLOAD_LIMIT,
                    max_request_bytes=REQUEST_LIMIT, control_queue=f"api-test-{uuid.uuid4().hex[:8]}",
                    batch_windows=WINDOWS, batch_promise_share=SHARE)


@pytest.fixture
async def pool(services_db):
    """A pool of one engine worker of its own model; announce(rate) says its measured pace."""
    model, engine_id = f"pool-{uuid.uuid4().hex[:8]}", f"engine-{uuid.uuid4().hex[:8]}"

    async def announce(rate: float) -> None:
        stats = EngineStats(max_seqs=8, max_model_len=CONTEXT, batch_rate=rate).to_json()
        async with services_db.begin() as conn:
            await engine_registry.announce(conn, engine_id, "http://127.0.0.1:9", model, "engine", stats)

    announce.model = model
    yield announce
    async with services_db.begin() as conn:
        await engine_registry.withdraw(conn, engine_id)


@pytest.fixture
def acts(settings, services_db):
    return BatchActivities(services_db, ObjectStore(settings.object_store_url), RequestLimits("ballast-tiny", 4096),
                           100, settings.windows, SHARE)


def lines(model: str, n: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps(dict(custom_id=f"c{i}", method="POST", url="/v1/chat/completions",
                                    body=dict(model=model, messages=[dict(role="user", content="hi")],
                                              max_tokens=max_tokens))).encode() + b"\n" for i in range(n))


async def create(client, model: str, n: int, max_tokens: int, window: str):
    f = await client.files.create(file=("in.jsonl", io.BytesIO(lines(model, n, max_tokens))), purpose="batch")
    return await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)


async def test_windows_are_promised_on_the_pools_pace_and_refused_past_it(client, pool, acts, services_db,
                                                                          temporal_api):
    # 100 tokens a second measured, 80 promised: 288,000 output tokens an hour, 1,152,000 in 4 h.
    await pool(100.0)
    first = await create(client, pool.model, 10, 20_000, "1h")  # 200,000: fits the hour
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(first.id, pool.model))
    got = await client.batches.retrieve(first.id)
    assert got.status == "in_progress" and got.expires_at == got.created_at + 3600
    promise = (await temporal_api.get(f"/v1/batches/{first.id}")).json()["ballast"]["promise"]
    assert (promise["window"], promise["ahead"], promise["rate"]) == ("1h", 200_000, 80.0)
    assert promise["deadline"] == got.created_at + 3600
    assert 2500 - 5 < promise["estimated_at"] - got.created_at <= 2500 + 5  # 200,000 ÷ 80, from validation

    # 100,000 more due within the hour: 300,000 > 288,000. Open at creation (its tokens are
    # not known yet), refused at validation, with nothing of it kept.
    await pool(100.0)
    second = await create(client, pool.model, 10, 10_000, "1h")
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(second.id, pool.model))
    refused = await client.batches.retrieve(second.id)
    assert refused.status == "failed" and refused.errors and refused.errors.data
    error = refused.errors.data[0]
    assert error.code == "completion_window_unattainable"
    assert "300000 output tokens" in (error.message or "") and "is 4h" in (error.message or "")
    async with services_db.connect() as conn:
        kept = (await conn.execute(text("SELECT count(*) FROM batch_items WHERE batch_id = :b"),
                                   dict(b=second.id))).scalar_one()
        reserved = (await conn.execute(text("SELECT count(*) FROM ledger WHERE subject = :s"),
                                       dict(s=f"batch:{second.id}"))).scalar_one()
    assert (kept, reserved) == (0, 0)

    # The same batch on 4 h goes after the first: 300,000 ≤ 1,152,000.
    await pool(100.0)
    later = await create(client, pool.model, 10, 10_000, "4h")
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(later.id, pool.model))
    assert (await client.batches.retrieve(later.id)).status == "in_progress"

    # The pace falls to 50 (40 promised: 144,000 an hour): the first's 200,000 alone fills
    # the hour, so a 1 h batch is refused at creation, a 400 in OpenAI's shape, nothing made.
    await pool(50.0)
    with pytest.raises(openai.BadRequestError) as err:
        await create(client, pool.model, 1, 1, "1h")
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "completion_window_unattainable"
    assert body["param"] == "completion_window" and "is 4h" in body["message"]

    # The audit view has each batch beside its promise.
    async with services_db.connect() as conn:
        rows = {r.batch_id: r for r in (await conn.execute(text(
            "SELECT batch_id, completion_window, ahead, rate, kept, status FROM batch_promises "
            "WHERE batch_id IN (:a, :b, :c)"), dict(a=first.id, b=second.id, c=later.id))).all()}
    assert (rows[first.id].ahead, rows[first.id].rate, rows[first.id].kept) == (200_000, 80.0, None)
    assert rows[second.id].ahead is None and rows[second.id].status == "failed"
    assert (rows[later.id].completion_window, rows[later.id].ahead) == ("4h", 300_000)


async def test_an_unmeasured_pool_promises_only_its_longest_window(client, pool, acts):
    await pool(0.0)
    with pytest.raises(openai.BadRequestError) as err:
        await create(client, pool.model, 1, 10, "1h")
    assert isinstance(err.value.body, dict) and "Use 24h" in err.value.body["message"]
    best_effort = await create(client, pool.model, 1, 10, "24h")
    await ActivityEnvironment().run(acts.validate_batch, ValidateInput(best_effort.id, pool.model))
    assert (await client.batches.retrieve(best_effort.id)).status == "in_progress"


async def test_a_window_not_offered_is_a_400_naming_those_that_are(temporal_api):
    r = await temporal_api.post("/v1/batches", json=dict(input_file_id="file-x", endpoint="/v1/chat/completions",
                                                         completion_window="2h"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"
    assert "'1h', '4h', '24h'" in r.json()["error"]["message"]
