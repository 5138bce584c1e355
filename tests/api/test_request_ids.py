"""x-request-id on every response, as OpenAI's API sends it: the client's own where usable,
else one made per request; refusals and errors carry it too. The official client's own view
(`_request_id`) is the check."""

from __future__ import annotations

import re
import uuid

import openai
import pytest

MADE = re.compile(r"req_[0-9a-f]{32}")


async def test_every_answer_carries_a_request_id_of_its_own(api, bare_api):
    answers = [
        await api.get("/v1/files"),  # 200
        await api.get("/v1/batches/batch_" + "0" * 24),  # 404
        await api.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        await bare_api.get("/v1/files", headers={"Authorization": "Bearer sk-ballast-" + "x" * 43}),  # 401
        await api.get("/healthz"),
        await api.get("/no-such-route"),
    ]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert [r.status_code for r in answers][:2] == [200, 404]
    assert all(i and MADE.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("sent,kept", [
    ("client-42.a_b:c", True),
    ("x" * 128, True),
    ("x" * 129, False),  # too long
    ("has space", False),
    ("na\u00efve", False),  # not ASCII: sent as its UTF-8 bytes
    ("", False),
])
async def test_a_clients_request_id_is_kept_where_usable(api, sent, kept):
    r = await api.get("/v1/files", headers={"x-request-id": sent.encode()})
    got = r.headers["x-request-id"]
    assert (got == sent) if kept else (MADE.fullmatch(got) is not None), got


async def test_the_official_client_sees_the_request_id(api):
    key = api.headers["Authorization"].split()[1]
    client = openai.AsyncOpenAI(api_key=key, base_url=str(api.base_url) + "/v1", http_client=api,
                                max_retries=0)
    mine = f"client-{uuid.uuid4().hex}"
    page = await client.files.list(extra_headers={"x-request-id": mine})
    assert page._request_id == mine
    with pytest.raises(openai.NotFoundError) as err:
        await client.batches.retrieve("batch_" + "0" * 24)
    assert MADE.fullmatch(err.value.request_id or ""), err.value.request_id
