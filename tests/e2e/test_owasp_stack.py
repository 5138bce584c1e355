"""tests/api/test_owasp.py's object- and function-level checks against the real processes:
`ballast api` over its socket, logged in to the journal as its own role, tenant A's
objects made through the API and run by the real workers (a file, a batch that completed
on the engine, a fine-tuning job, cancelled). Tenant B, with a key of its own, calls every
/v1 route that takes an id with A's ids and with ids that exist nowhere: the answers match,
and A's objects are as they were. Every /admin route refuses A's tenant key and no key.

Model routes are left to the in-process suite: A would need a fine-tuned model of its own,
that is a whole training run here.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from api.app import create_app
from config import Settings
from protocol.finetune import MIN_EXAMPLES
from tests.api.conftest import assert_openai_error
from tests.api.test_owasp import UNKNOWN, fill, id_routes
from tests.e2e.conftest import make_key, start_batch

pytestmark = pytest.mark.e2e


def _wait(client: httpx.Client, path: str, done: set[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while (body := client.get(path).json())["status"] not in done:
        assert time.monotonic() < deadline, body
        time.sleep(0.3)
    return body


def test_another_tenants_ids_and_the_admin_api_on_the_real_stack(stack, db_url, tiny_model):
    a = stack.http()
    b = httpx.Client(base_url=stack.url, timeout=60,
                     headers={"Authorization": f"Bearer {make_key(db_url, 'owasp-b-' + uuid.uuid4().hex[:8])}"})
    file_id, batch_id = start_batch(a, tiny_model.name, "hello", 4)
    chat = dict(messages=[dict(role="user", content="hi"), dict(role="assistant", content="hello")])
    # Enough examples to pass validation: a job that failed it could no longer be cancelled.
    train_id = a.post("/v1/files", files={"file": ("train.jsonl", (json.dumps(chat) + "\n") * MIN_EXAMPLES)},
                      data={"purpose": "fine-tune"}).json()["id"]
    # Fifty epochs: far longer than the cancel takes to land, so it never races the last step.
    job = a.post("/v1/fine_tuning/jobs", json=dict(model=tiny_model.name, training_file=train_id,
                                                   hyperparameters=dict(n_epochs=50)))
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]
    assert a.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    batch = _wait(a, f"/v1/batches/{batch_id}", {"completed", "failed", "expired", "cancelled"})
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch
    job_before = _wait(a, f"/v1/fine_tuning/jobs/{job_id}", {"cancelled", "failed", "succeeded"})
    assert job_before["status"] == "cancelled", job_before
    # A webhook of A's, deleted at the end: none of A's work ends while it exists.
    hook = a.post("/v1/webhooks", json=dict(url="https://example.com/a"))
    assert hook.status_code == 200, hook.text
    objects = dict(file_id=file_id, batch_id=batch_id, fine_tuning_job_id=job_id, webhook_id=hook.json()["id"])
    before = {p: a.get(p).json() for p in (f"/v1/files/{file_id}", f"/v1/batches/{batch_id}",
                                             f"/v1/fine_tuning/jobs/{job_id}")}
    assert before[f"/v1/fine_tuning/jobs/{job_id}"] == job_before

    app = create_app(Settings())  # its routes only: nothing runs
    routes = [(m, t) for m, t in id_routes(app) if "{model" not in t]
    assert len(routes) >= 10, routes  # files, batches and fine-tuning jobs: all of them, not none
    for method, template in routes:
        theirs = b.request(method, fill(template, objects))
        unknown = b.request(method, fill(template, UNKNOWN))
        param = re.search(r"\{(\w+)", template)[1]
        mine = assert_openai_error(theirs, 404, param)
        ref = assert_openai_error(unknown, 404, param)
        assert mine["message"].replace(objects[param], "ID") == ref["message"].replace(UNKNOWN[param], "ID"), \
            (method, template, mine, ref)
    # A's objects are as they were: nothing B sent (a DELETE, a cancel, a pause) reached them.
    assert {p: a.get(p).json() for p in before} == before
    assert a.delete(f"/v1/webhooks/{objects['webhook_id']}").status_code == 200  # B's DELETE did not
    assert a.get(f"/v1/files/{batch['output_file_id']}/content").status_code == 200

    admin = sorted((m, r.path) for r in app.routes if getattr(r, "path", "").startswith("/admin/")
                   for m in getattr(r, "methods", ()))
    assert len(admin) >= 6, admin
    values = dict(tenant_id="default", key_id="key_" + "0" * 24, engine_id="nobody-1")
    with httpx.Client(base_url=stack.url, timeout=30) as anonymous:
        for method, template in admin:
            path = fill(template, values)
            err = assert_openai_error(a.request(method, path, json={}), 403, code="admin_key_required")
            assert err["type"] == "permission_error", (method, path)
            assert_openai_error(anonymous.request(method, path, json={}), 401)
