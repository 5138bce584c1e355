"""/v1/models: exactly what a caller can call (the deployment's model and every model a
serving engine pool announces), in OpenAI's shape."""

from __future__ import annotations

import uuid

import httpx
import pytest

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


async def test_another_pools_model_is_listed_while_an_engine_serves_it_with_its_own_context(api, services_db):
    db = services_db  # an engine announces, the operator drains
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


async def test_a_tenant_deletes_its_fine_tuned_model_as_openais_client_does(api, other_api, db, services_db):
    """Gone from the list and from every call, its adapter and checkpoints gone from the
    store; its job stays, with its history. Only its tenant can, and only a fine-tuned model."""
    import time

    import openai

    from journal import finetune_store
    from journal.events import append_one
    from journal.leases import acquire
    from protocol import keys

    job_id = "ftjob-" + uuid.uuid4().hex[:24]
    model = f"ft:ballast-tiny:gone:{job_id}"
    store, now = api.services.store, int(time.time())
    owned = [keys.checkpoint(job_id, 2), *(f"{keys.adapter(job_id)}/{n}" for n in keys.ADAPTER_FILES)]
    for key in owned:
        with store.writer(key) as f:
            f.write(b"weights")
    async with services_db.begin() as conn:  # a job trained and checkpointed, as the workers journal it
        await finetune_store.create_job(conn, dict(
            id=job_id, tenant="default", model="ballast-tiny", training_file="file-x", validation_file=None,
            hyperparameters=dict(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0), seed=1, suffix="gone",
            metadata=None, status="succeeded", error=None, fine_tuned_model=model, trained_tokens=1, result_files=[],
            created_at=now, finished_at=now))
        fence = await acquire(conn, keys.ftjob(job_id), "test")  # a checkpoint is an attempt's, fenced
        await append_one(conn, finetune_store.checkpoint_event(job_id, "default", 2, owned[0], "0" * 64, [1.0], fence))
    assert model in await _listed(api)
    assert_openai_error(await other_api.delete(f"/v1/models/{model}"), 404, "model", "model_not_found")
    assert_openai_error(await api.delete("/v1/models/ballast-tiny"), 403, "model", "model_not_deletable")

    client = openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=api.headers["authorization"][7:],
                                max_retries=0, http_client=httpx.AsyncClient(transport=api._transport))
    gone = await client.models.delete(model)
    assert (gone.id, gone.deleted, gone.object) == (model, True, "model")
    assert model not in await _listed(api) and not any(store.exists(k) for k in owned)
    assert_openai_error(await api.get(f"/v1/models/{model}"), 404, "model", "model_not_found")
    chat = dict(model=model, max_tokens=1, messages=[dict(role="user", content="hi")])
    assert_openai_error(await api.post("/v1/chat/completions", json=chat), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        await client.models.delete(model)  # once
    job = (await api.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == model  # the record stays
