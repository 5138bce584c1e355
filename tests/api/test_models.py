"""/v1/models: exactly what a caller can call (the deployment's model and every model a
serving engine pool announces), in OpenAI's shape."""

from __future__ import annotations

import uuid

from journal import engine_registry
from tests.api.conftest import assert_openai_error


async def _announce(db, model: str, **stats) -> str:
    engine_id = f"test-{uuid.uuid4().hex[:8]}"
    async with db.begin() as conn:
        await engine_registry.announce(conn, engine_id, "http://127.0.0.1:1", model, "q", stats)
    return engine_id


async def _listed(api) -> list[str]:
    return [m["id"] for m in (await api.get("/v1/models")).json()["data"]]


async def test_lists_the_deployments_model_first_with_a_stable_created(api):
    first = (await api.get("/v1/models")).json()
    assert first["object"] == "list"
    own = first["data"][0]
    assert set(own) == {"id", "object", "created", "owned_by"}
    assert own["id"] == "ballast-tiny" and own["object"] == "model" and isinstance(own["created"], int)
    assert (await api.get("/v1/models")).json()["data"][0] == own
    assert (await api.get("/v1/models/ballast-tiny")).json() == own


async def test_another_pools_model_is_listed_while_an_engine_serves_it_with_its_own_context(api, db):
    engine_id = await _announce(db, "org/other-model", max_model_len=64)  # hub ids have a slash
    try:
        assert await _listed(api) == ["ballast-tiny", "org/other-model"]
        assert (await api.get("/v1/models/org/other-model")).json()["id"] == "org/other-model"
        # Checked against its own pool's context (64 tokens), not the deployment's model's.
        chat = dict(model="org/other-model", messages=[dict(role="user", content="hi")])
        assert_openai_error(await api.post("/v1/chat/completions", json=dict(chat, max_tokens=65)), 400,
                            "max_tokens", "context_length_exceeded")
        async with db.begin() as conn:
            await engine_registry.drain(conn, engine_id)
        await api.services.engines.refresh()
        assert await _listed(api) == ["ballast-tiny"]  # a draining pool takes nothing new
    finally:
        async with db.begin() as conn:
            await engine_registry.withdraw(conn, engine_id)
    await api.services.engines.refresh()
    assert await _listed(api) == ["ballast-tiny"]
    assert_openai_error(await api.get("/v1/models/org/other-model"), 404, "model", "model_not_found")
    got = await api.post("/v1/chat/completions", json=dict(model="org/other-model", max_tokens=1,
                                                           messages=[dict(role="user", content="hi")]))
    assert_openai_error(got, 404, "model", "model_not_found")


async def test_an_unknown_model_is_404_model_not_found(api):
    assert_openai_error(await api.get("/v1/models/gpt-9"), 404, "model", "model_not_found")
    assert_openai_error(await api.get("/v1/models/%00%ED%A0%80"), 404, "model", "model_not_found")
