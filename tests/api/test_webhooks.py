"""/v1/webhooks in process, as the API's own role: registering answers the signing secret
once (never again: not in a list, not in a retrieve); bad input is a 400 in OpenAI's shape
naming what; another tenant's endpoint is a 404 for every call; a tenant's endpoints are
bounded (409, not retried by OpenAI's clients); deleting stops it being listed."""

from __future__ import annotations

import base64
from typing import get_args

import pytest

from api.webhooks import EventType
from protocol.webhooks import EVENT_TYPES
from tests.api.conftest import assert_openai_error, tenant_api


@pytest.fixture
async def http(settings, db):
    async with tenant_api(settings, db, "hooks") as client:
        yield client


def test_the_accepted_event_types_are_the_raised_ones():
    assert list(get_args(EventType)) == list(EVENT_TYPES)


async def test_register_shows_the_secret_once(http):
    r = await http.post("/v1/webhooks", json=dict(url="https://example.com/hooks?x=1", description="ops"))
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["id"].startswith("wh_") and made["object"] == "webhook"
    assert made["events"] == list(EVENT_TYPES)  # default: all of them
    assert (made["url"], made["description"]) == ("https://example.com/hooks?x=1", "ops")
    assert made["secret"].startswith("whsec_") and len(base64.b64decode(made["secret"][6:])) == 32
    got = (await http.get(f"/v1/webhooks/{made['id']}")).json()
    assert got == {k: v for k, v in made.items() if k != "secret"}
    listed = (await http.get("/v1/webhooks")).json()
    assert listed["object"] == "list" and [w["id"] for w in listed["data"]] == [made["id"]]
    assert "secret" not in listed["data"][0] and made["secret"] not in (await http.get("/v1/webhooks")).text

    some = await http.post("/v1/webhooks", json=dict(url="http://127.0.0.1:9/h",
                                                     events=["fine_tuning.job.failed", "batch.failed",
                                                             "batch.failed"]))
    assert some.json()["events"] == ["batch.failed", "fine_tuning.job.failed"]  # once each, in order
    assert some.json()["secret"] != made["secret"]


@pytest.mark.parametrize("body, param", [
    (dict(url="ftp://example.com/x"), "url"),
    (dict(url="example.com/hook"), "url"),
    (dict(url="/relative"), "url"),
    (dict(url="https://"), "url"),
    (dict(url="https://user:pw@example.com/"), "url"),
    (dict(url="https://example.com/#frag"), "url"),
    (dict(url="https://example.com:99999/"), "url"),
    (dict(url="https://exa mple.com/"), "url"),
    (dict(url=" https://example.com/"), "url"),
    (dict(url="https://example.com/\u0000"), "url"),
    (dict(url="https://example.com/" + "x" * 3000), "url"),
    (dict(), "url"),
    (dict(url=3), "url"),
    (dict(url="https://example.com/", events=["batch.started"]), "events.0"),
    (dict(url="https://example.com/", events=[]), "events"),
    (dict(url="https://example.com/", events="batch.completed"), "events"),
    (dict(url="https://example.com/", description="\u0000"), "description"),
    (dict(url="https://example.com/", description="d" * 513), "description"),
])
async def test_bad_input_is_a_400_naming_it(http, body, param):
    r = await http.post("/v1/webhooks", json=body)
    assert_openai_error(r, 400, param)
    assert (await http.get("/v1/webhooks")).json()["data"] == []


async def test_another_tenants_endpoint_is_not_found(http, settings, db):
    made = (await http.post("/v1/webhooks", json=dict(url="https://example.com/"))).json()
    async with tenant_api(settings, db, "others") as other:
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/deliveries")):
            r = await other.request(method, f"/v1/webhooks/{made['id']}{path}")
            assert_openai_error(r, 404, "webhook_id", "not_found")
        assert (await other.get("/v1/webhooks")).json()["data"] == []
    assert (await http.get(f"/v1/webhooks/{made['id']}")).status_code == 200  # untouched


async def test_delete_and_deliveries(http):
    made = (await http.post("/v1/webhooks", json=dict(url="https://example.com/"))).json()
    d = (await http.get(f"/v1/webhooks/{made['id']}/deliveries")).json()
    assert d == dict(object="list", data=[], has_more=False)
    assert_openai_error(await http.get(f"/v1/webhooks/{made['id']}/deliveries?limit=0"), 400, "limit")
    r = await http.delete(f"/v1/webhooks/{made['id']}")
    assert r.json() == dict(id=made["id"], object="webhook.deleted", deleted=True)
    assert_openai_error(await http.delete(f"/v1/webhooks/{made['id']}"), 404, "webhook_id")
    assert_openai_error(await http.get(f"/v1/webhooks/{made['id']}"), 404, "webhook_id")
    assert (await http.get("/v1/webhooks")).json()["data"] == []
    assert_openai_error(await http.get("/v1/webhooks/not%20an%20id"), 404, "webhook_id")


async def test_a_tenant_has_at_most_its_endpoints(settings, db):
    async with tenant_api(settings.model_copy(update=dict(max_webhooks_per_tenant=2)), db, "few") as http:
        ids = [(await http.post("/v1/webhooks", json=dict(url=f"https://example.com/{i}"))).json()["id"]
               for i in range(2)]
        r = await http.post("/v1/webhooks", json=dict(url="https://example.com/3"))
        assert_openai_error(r, 409, "url", "webhook_limit_reached")
        assert r.headers["x-should-retry"] == "false"
        await http.delete(f"/v1/webhooks/{ids[0]}")
        assert (await http.post("/v1/webhooks", json=dict(url="https://example.com/3"))).status_code == 200
