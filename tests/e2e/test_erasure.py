"""Erasing a tenant's content on the real stack (POST /admin/tenants/{id}/erase): its
batch ran on vLLM and its fine-tune trained and was served; afterwards no byte of what it
sent or got is in the journal, the object store or the API, while the books are whole:
every event is still there (only file deletions, the model's deletion and the erasure
itself are new), the token counts and usage are what the client was given, the ledger is
unchanged row for row, and another tenant's content is untouched. The oracles are the
client's own record and SQL over the journal as its owner."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest

from config.database import libpq_url
from journal import tenant_store
from journal.db import connect
from protocol import keys
from tests.api.conftest import assert_openai_error
from tests.e2e.conftest import make_key

pytestmark = pytest.mark.e2e

ENDED = {"completed", "failed", "expired", "cancelled", "succeeded"}


def _admin_key(db_url: str) -> str:
    async def make() -> str:
        db = connect(db_url, pool_size=1)
        try:
            async with db.begin() as conn:
                return (await tenant_store.create_key(conn, None, "e2e-erasure", admin=True))[1]
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make()).result()


def _wait(client: httpx.Client, path: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while (body := client.get(path).json())["status"] not in ENDED:
        assert time.monotonic() < deadline, body
        time.sleep(0.3)
    return body


def _batch(client: httpx.Client, model: str, secret: str) -> dict:
    lines = "".join(json.dumps(dict(custom_id=f"c{i}", method="POST", url="/v1/completions",
                                    body=dict(model=model, prompt=f"{secret} number {i}", max_tokens=6,
                                              temperature=0))) + "\n" for i in range(3))
    file_id = client.post("/v1/files", files={"file": (f"{secret}.jsonl", lines)},
                          data={"purpose": "batch"}).json()["id"]
    r = client.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
                                             metadata=dict(project=secret)))
    assert r.status_code == 200, r.text
    batch = _wait(client, f"/v1/batches/{r.json()['id']}")
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3, batch
    return batch


def _journal(db_url: str, tenant: str) -> dict:
    """What SQL over the journal says of the tenant, as its owner."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        types: dict[str, int] = dict(conn.execute("SELECT type, count(*) FROM events WHERE tenant = %s GROUP BY 1",
                                                  (tenant,)).fetchall())
        row = conn.execute(
            "SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0),"
            " count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(payload->'token_ids') t"
            "                                    WHERE t <> '-1'))"
            " FROM events WHERE tenant = %s AND type = 'item_chunk'", (tenant,)).fetchone()
        assert row is not None
        tokens, erased = row
        results = [p for (p,) in conn.execute(
            "SELECT payload FROM events WHERE tenant = %s AND type = 'item_completed' ORDER BY position",
            (tenant,)).fetchall()]
        ledger = conn.execute("SELECT * FROM ledger WHERE tenant = %s ORDER BY position", (tenant,)).fetchall()
        text = "\n".join(p for (p,) in conn.execute(
            "SELECT payload::text FROM events WHERE tenant = %s ORDER BY position", (tenant,)).fetchall())
        items = "\n".join(b for (b,) in conn.execute(
            "SELECT i.body::text FROM batch_items i JOIN batches b ON b.id = i.batch_id WHERE b.tenant = %s",
            (tenant,)).fetchall())
        names = [n for (n,) in conn.execute("SELECT filename FROM files WHERE tenant = %s", (tenant,)).fetchall()]
    return dict(types=types, tokens=tokens, chunks_erased=erased, results=results, ledger=ledger, text=text,
                items=items, names=names)


def test_erasing_a_tenants_content_leaves_its_books_whole(stack, db_url, tiny_model):
    tag = uuid.uuid4().hex[:8]
    tenant, other = f"erase-a-{tag}", f"erase-b-{tag}"
    secret, kept = f"zebra{tag}", f"okapi{tag}"
    a = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {make_key(db_url, tenant)}"})
    b = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {make_key(db_url, other)}"})
    admin = httpx.Client(base_url=stack.url, timeout=120, headers={"Authorization": f"Bearer {_admin_key(db_url)}"})

    # A: a batch and a fine-tune, each carrying the secret; B: a batch of its own.
    batch = _batch(a, tiny_model.name, secret)
    theirs = _batch(b, tiny_model.name, kept)
    output = [json.loads(line) for line in a.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
    got = {o["custom_id"]: o["response"]["body"] for o in output}
    assert len(got) == 3 and all(body["choices"][0]["text"] for body in got.values())
    chats = [dict(messages=[dict(role="user", content=f"{secret} {i}?"), dict(role="assistant", content=f"{secret}")])
             for i in range(10)]
    train = a.post("/v1/files", files={"file": ("train.jsonl", "".join(json.dumps(c) + "\n" for c in chats))},
                   data={"purpose": "fine-tune"}).json()["id"]
    r = a.post("/v1/fine_tuning/jobs", json=dict(model=tiny_model.name, training_file=train, suffix="erase",
                                                  hyperparameters=dict(n_epochs=1), metadata=dict(owner=secret)))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]

    # While the job runs, erasure is refused and nothing is erased (the job goes on journaling).
    err = assert_openai_error(admin.post(f"/admin/tenants/{tenant}/erase"), 409, "tenant_id", "tenant_busy")
    assert job_id in err["message"]
    refused = _journal(db_url, tenant)
    assert not {"content_erased", "file_deleted", "ft_model_deleted"} & set(refused["types"])
    assert secret in refused["text"] and refused["chunks_erased"] == 0
    job = _wait(a, f"/v1/fine_tuning/jobs/{job_id}")
    assert job["status"] == "succeeded", job
    model = job["fine_tuned_model"]
    chat = a.post("/v1/chat/completions", json=dict(model=model, max_tokens=2,
                                                    messages=[dict(role="user", content=f"{secret} 1?")]))
    assert chat.status_code == 200, chat.text
    # Its outcome and settle come in one transaction after the answer, and the engine's
    # record of it on the engine's next journal tick: the books are still until both are in.
    deadline = time.monotonic() + 60
    while any(_journal(db_url, tenant)["types"].get(t) != 1 for t in ("request_finished", "request_served")):
        assert time.monotonic() < deadline, "the chat was never journaled"
        time.sleep(0.2)

    files = [f["id"] for f in a.get("/v1/files", params=dict(limit=100)).json()["data"]]
    assert len(files) >= 4  # the batch's input and output, the training file, the job's results
    ckpts = [c["step_number"] for c in a.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]]
    objects = [stack.root / "objects" / keys.file(f) for f in files]
    objects += [stack.root / "objects" / keys.checkpoint(job_id, s) for s in ckpts]
    objects += [stack.root / "objects" / keys.adapter(job_id) / n for n in keys.ADAPTER_FILES]
    assert ckpts and all(p.exists() for p in objects)
    before, other_before = _journal(db_url, tenant), _journal(db_url, other)
    assert secret in before["text"] and secret in before["items"] and before["tokens"] > 0  # content was there

    r = admin.post(f"/admin/tenants/{tenant}/erase")
    assert r.status_code == 200, r.text
    done = r.json()
    assert (done["object"], done["tenant"], done["files"], done["models"]) == ("tenant.erasure", tenant, len(files), 1)
    assert (done["requests"], done["results"]) == (3, 3) and done["chunks"] >= 3

    after = _journal(db_url, tenant)
    # Gone: the content, from the journal, the read models, the object store and the API.
    assert secret not in after["text"] and secret not in after["items"] and after["names"] == []
    assert after["chunks_erased"] == after["types"]["item_chunk"]  # every token id masked
    assert not any(p.exists() for p in objects)
    assert a.get("/v1/files").json()["data"] == []
    for f in files:
        assert_openai_error(a.get(f"/v1/files/{f}/content"), 404, "file_id")
    assert model not in [m["id"] for m in a.get("/v1/models").json()["data"]]
    assert a.post("/v1/chat/completions", json=dict(model=model, messages=[dict(role="user", content="x")],
                                                    max_tokens=2)).status_code == 404
    # Kept: every event, the tokens counted, each response's usage as the client got it, the ledger.
    new = dict(file_deleted=len(files), ft_model_deleted=1, content_erased=1)
    assert {t: n - new.get(t, 0) for t, n in after["types"].items() if n - new.get(t, 0)} == before["types"]
    assert after["tokens"] == before["tokens"]
    usage = sorted(json.dumps(json.loads(p["body_json"])["usage"], sort_keys=True) for p in after["results"])
    assert usage == sorted(json.dumps(body["usage"], sort_keys=True) for body in got.values())
    assert all(json.loads(p["body_json"]).keys() == {"erased", "usage"} for p in after["results"])
    # Erasure writes no ledger row and changes none (admission's writer may still be adding
    # the chat's reservation rows, which no erasure touches either).
    assert set(before["ledger"]) <= set(after["ledger"])
    assert all(row[5] != "settle" for row in set(after["ledger"]) - set(before["ledger"]))
    assert a.get(f"/v1/batches/{batch['id']}").json()["request_counts"] == batch["request_counts"]
    assert a.get(f"/v1/fine_tuning/jobs/{job_id}").json()["trained_tokens"] == job["trained_tokens"]
    # The other tenant's content is untouched.
    assert _journal(db_url, other) == other_before and kept in other_before["text"]
    assert b.get(f"/v1/files/{theirs['output_file_id']}/content").status_code == 200

    # Again: nothing left to erase, and the second erasure is on the record too.
    again = admin.post(f"/admin/tenants/{tenant}/erase").json()
    assert [again[k] for k in ("files", "objects", "models", "requests", "chunks", "results")] == [0, 0, 0, 0, 0, 0]
    assert _journal(db_url, tenant)["types"]["content_erased"] == 2
    assert_openai_error(admin.post("/admin/tenants/nobody-here/erase"), 404, "tenant_id")
