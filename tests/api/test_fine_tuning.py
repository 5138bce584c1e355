"""/v1/fine_tuning/jobs through the official OpenAI client, unchanged: upload with
purpose "fine-tune", create, retrieve, list, pause, resume, cancel, events, checkpoints;
bad input is a 4xx in OpenAI's error shape and creates nothing. In process, on real
Postgres and a real Temporal server whose control queue no worker polls (the workflow
starts; what it journals is written here by hand, as its activities would)."""

from __future__ import annotations

import io
import json

import openai
import pytest
from sqlalchemy import text

from journal import finetune_store
from journal.events import append
from journal.leases import acquire
from protocol import keys
from tests.api.conftest import build

LINES = "".join(json.dumps(dict(messages=[dict(role="user", content=f"q{i}"), dict(role="assistant", content="a")]))
                + "\n" for i in range(10)).encode()


async def upload(client, purpose: str = "fine-tune") -> str:
    return (await client.files.create(file=("train.jsonl", io.BytesIO(LINES)), purpose=purpose)).id


async def count_jobs(db) -> int:
    async with db.connect() as c:
        return (await c.execute(text("SELECT count(*) FROM fine_tuning_jobs"))).scalar_one()


async def test_a_job_is_created_started_and_listed_as_openai_shapes_it(client, temporal_client, settings):
    file_id = await upload(client)
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, suffix="colours",
                                               hyperparameters=dict(n_epochs=2), metadata=dict(team="a"))
    assert job.object == "fine_tuning.job" and job.status == "validating_files" and job.model == "ballast-tiny"
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 1  # "auto": the default
    assert job.hyperparameters.learning_rate_multiplier == 1.0 and isinstance(job.seed, int)
    assert job.training_file == file_id and job.fine_tuned_model is None and job.metadata == dict(team="a")
    assert (await client.fine_tuning.jobs.retrieve(job.id)).id == job.id
    assert job.id in [j.id async for j in client.fine_tuning.jobs.list()]
    desc = await temporal_client.get_workflow_handle(f"ftjob:{job.id}").describe()
    assert desc.workflow_type == "FineTune" and desc.task_queue == settings.control_queue


async def test_bad_input_is_a_4xx_and_creates_nothing(client, db):
    file_id, batch_file = await upload(client), await upload(client, "batch")
    before = await count_jobs(db)
    cases = [
        (dict(model="gpt-4o", training_file=file_id), 400, "model_not_available"),
        (dict(model="ballast-tiny", training_file=batch_file), 400, "invalid_value"),
        (dict(model="ballast-tiny", training_file="file-nope"), 404, "not_found"),
        (dict(model="ballast-tiny", training_file=file_id, suffix="no spaces"), 400, "invalid_value"),
        (dict(model="ballast-tiny", training_file=file_id, hyperparameters=dict(n_epochs=0)), 400, "invalid_value"),
        (dict(model="ballast-tiny", training_file=file_id, hyperparameters=dict(learning_rate_multiplier=-1)), 400,
         "invalid_value"),
    ]
    for body, status, code in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.fine_tuning.jobs.create(**body)
        assert (caught.value.status_code, caught.value.code) == (status, code), body
        assert caught.value.body["message"]
    assert await count_jobs(db) == before


async def test_another_tenants_job_is_not_found(client, other_api):
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=await upload(client))
    assert (await other_api.get(f"/v1/fine_tuning/jobs/{job.id}")).status_code == 404
    assert (await other_api.post(f"/v1/fine_tuning/jobs/{job.id}/cancel")).status_code == 404
    assert job.id not in [j["id"] for j in (await other_api.get("/v1/fine_tuning/jobs")).json()["data"]]


async def test_pause_resume_and_cancel_follow_the_status(client, db):
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=await upload(client))
    with pytest.raises(openai.BadRequestError, match="Cannot resume a fine-tuning job with status validating_files"):
        await client.fine_tuning.jobs.resume(job.id)
    assert (await client.fine_tuning.jobs.pause(job.id)).id == job.id  # signalled
    async with db.begin() as c:
        row = await finetune_store.get_job(c, job.id)
        await finetune_store.move_status(c, row, "paused")
    assert (await client.fine_tuning.jobs.resume(job.id)).status == "paused"  # it moves once the workflow does
    async with db.begin() as c:
        await finetune_store.move_status(c, row, "cancelled")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a fine-tuning job with status cancelled"):
        await client.fine_tuning.jobs.cancel(job.id)


async def test_events_and_checkpoints_list_what_the_journal_holds_newest_first(client, services_db):
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=await upload(client))
    async with services_db.begin() as c:  # as the engine worker training it journals them
        fence = await acquire(c, keys.ftjob(job.id), "test")
    async with services_db.begin() as c:
        await append(c, [
            finetune_store.checkpoint_event(job.id, "default", 2, keys.checkpoint(job.id, 2), "a" * 64, [2.0, 1.5],
                                            fence),
            finetune_store.job_event(job.id, "default", "step:2", "Step 2/4: training loss=1.5000"),
            finetune_store.checkpoint_event(job.id, "default", 4, keys.checkpoint(job.id, 4), "b" * 64, [1.2, 1.0],
                                            fence),
            finetune_store.job_event(job.id, "default", "step:4", "Step 4/4: training loss=1.0000"),
        ])
    events = [e async for e in client.fine_tuning.jobs.list_events(job.id)]
    assert [e.message for e in events] == ["Step 4/4: training loss=1.0000", "Step 2/4: training loss=1.5000"]
    ckpts = [c async for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    assert [(c.step_number, c.metrics.train_loss) for c in ckpts] == [(4, 1.0), (2, 1.5)]
    assert ckpts[0].fine_tuned_model_checkpoint == f"ft:ballast-tiny::{job.id}:ckpt-step-4"
    page = await client.fine_tuning.jobs.list_events(job.id, limit=1)
    assert [e.message for e in page.data] == ["Step 4/4: training loss=1.0000"] and page.has_more


async def test_an_unknown_job_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        await client.fine_tuning.jobs.retrieve("ftjob-nope")
    assert caught.value.code == "not_found" and "ftjob-nope" in caught.value.body["message"]



async def test_active_jobs_past_the_tenants_limit_are_refused_at_creation(settings, db, temporal_client):
    """`concurrent_fine_tunes`: a 429 in OpenAI's shape with Retry-After, nothing created;
    counted per model and across models ('*'); a job that ends frees its place; two
    creations at once cannot both take the last one."""
    import asyncio
    import uuid

    from journal import tenant_store
    from tests.api.conftest import build, new_key

    tenant = "ft-limited-" + uuid.uuid4().hex[:8]
    async with build(settings, db, temporal_client, await new_key(db, tenant)) as http, \
            openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=http.headers["Authorization"][7:],
                               max_retries=0, http_client=http) as c:
        file_id = await upload(c)
        async with db.begin() as conn:
            await tenant_store.set_limits(conn, tenant, "*", concurrent_fine_tunes=3)
            await tenant_store.set_limits(conn, tenant, "ballast-tiny", concurrent_fine_tunes=2)

        async def create():
            return await c.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id)

        got = await asyncio.gather(create(), create(), create(), return_exceptions=True)
        made = [j for j in got if not isinstance(j, BaseException)]
        refused = [e for e in got if isinstance(e, BaseException)]
        assert len(made) == 2 and len(refused) == 1  # the model's limit, taken at once by three
        err = refused[0]
        assert isinstance(err, openai.RateLimitError) and err.code == "rate_limit_exceeded"
        assert err.response.headers["Retry-After"] == "60"
        assert err.body["message"] == (f"You have reached the maximum number of active fine-tuning jobs for "
                                       f"ballast-tiny in tenant {tenant}: Limit 2, Active 2. Cancel one or wait "
                                       "for one to finish, then try again.")
        async with db.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM fine_tuning_jobs WHERE tenant = :t"),
                                       dict(t=tenant))).scalar_one() == 2
        async with db.begin() as conn:  # one ends: its place is free
            await finetune_store.move_status(conn, await finetune_store.get_job(conn, made[0].id), "cancelled")
        await create()
        async with db.begin() as conn:  # the model's limit lifted: the tenant's own (3) binds
            await tenant_store.set_limits(conn, tenant, "ballast-tiny", concurrent_fine_tunes=None)
            await finetune_store.move_status(conn, await finetune_store.get_job(conn, made[1].id),
                                             "paused")  # paused still counts
        await create()
        with pytest.raises(openai.RateLimitError, match="for all models in tenant .*: Limit 3, Active 3"):
            await create()


# -- the LoRA adapter's hyperparameters (Ballast's extensions to OpenAI's) ---------------------


async def stored_hyperparameters(db, job_id: str) -> dict:
    async with db.connect() as c:
        job = await finetune_store.get_job(c, job_id)
    assert job is not None
    return job["hyperparameters"]


async def test_lora_hyperparameters_are_stored_with_the_job_for_its_trainer(client, db):
    """lora_rank, lora_alpha and lora_target_modules, given as OpenAI's `hyperparameters` or
    its `method.supervised.hyperparameters`, are what the job stores (what its engine worker's
    trainer reads: activities/finetune.py) and what the job object shows; unsaid, "auto":
    rank 8, alpha 16 on q_proj and v_proj."""
    file_id = await upload(client)
    four = ["q_proj", "k_proj", "v_proj", "o_proj"]
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, hyperparameters=dict(
        n_epochs=2, lora_rank=4, lora_alpha=8, lora_target_modules=four))
    hp = await stored_hyperparameters(db, job.id)
    assert (hp["lora_rank"], hp["lora_alpha"], hp["lora_target_modules"], hp["n_epochs"]) == (4, 8.0, four, 2)
    shown = job.hyperparameters.model_dump()
    assert (shown["lora_rank"], shown["lora_alpha"], shown["lora_target_modules"]) == (4, 8.0, four)

    method = dict(type="supervised", supervised=dict(hyperparameters=dict(lora_rank=2, lora_target_modules=[
        "self_attn.q_proj"], batch_size=2)))
    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, method=method)
    hp = await stored_hyperparameters(db, job.id)
    assert (hp["lora_rank"], hp["lora_alpha"], hp["lora_target_modules"], hp["batch_size"]) == (
        2, 16.0, ["self_attn.q_proj"], 2)

    job = await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id,
                                               hyperparameters=dict(lora_rank="auto", lora_alpha="auto"))
    hp = await stored_hyperparameters(db, job.id)
    assert (hp["lora_rank"], hp["lora_alpha"], hp["lora_target_modules"]) == (8, 16.0, ["q_proj", "v_proj"])
    assert (await client.fine_tuning.jobs.retrieve(job.id)).hyperparameters.model_dump()["lora_rank"] == 8


async def test_bad_lora_hyperparameters_are_a_400_naming_the_param_and_create_nothing(client, db, settings):
    file_id = await upload(client)
    above = settings.max_lora_rank * 2  # a power of two the engines do not serve
    cases = [
        (dict(lora_rank=3), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank=0), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank=-8), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank="8"), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank=True), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank=8.5), "hyperparameters.lora_rank", "power of two"),
        (dict(lora_rank=above), "hyperparameters.lora_rank", f"LoRA ranks up to {settings.max_lora_rank}"),
        (dict(lora_alpha=0), "hyperparameters.lora_alpha", "above 0"),
        (dict(lora_alpha=-1.5), "hyperparameters.lora_alpha", "above 0"),
        (dict(lora_alpha="big"), "hyperparameters.lora_alpha", "above 0"),
        (dict(lora_target_modules=[]), "hyperparameters.lora_target_modules", "list of 1 to"),
        (dict(lora_target_modules="q_proj"), "hyperparameters.lora_target_modules", "list of 1 to"),
        (dict(lora_target_modules=[7]), "hyperparameters.lora_target_modules", "list of 1 to"),
        (dict(lora_target_modules=["q proj"]), "hyperparameters.lora_target_modules", "list of 1 to"),
        (dict(lora_target_modules=["q_proj", ""]), "hyperparameters.lora_target_modules", "list of 1 to"),
        (dict(lora_target_modules=["q_proj", "q_proj"]), "hyperparameters.lora_target_modules", "twice"),
    ]
    before = await count_jobs(db)
    for given, param, says in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, hyperparameters=given)
        err = caught.value.body
        assert (caught.value.code, err["param"]) == ("invalid_value", param), given
        assert says in err["message"], (given, err["message"])
    # Given as method.supervised.hyperparameters, the error names that path.
    with pytest.raises(openai.BadRequestError) as caught:
        await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, method=dict(
            type="supervised", supervised=dict(hyperparameters=dict(lora_rank=above))))
    assert caught.value.body["param"] == "method.supervised.hyperparameters.lora_rank"
    # Only supervised fine-tuning trains here, and the hyperparameters are given in one place.
    with pytest.raises(openai.BadRequestError) as caught:
        await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, method=dict(type="dpo"))
    assert caught.value.body["param"] == "method.type"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id,
                                             hyperparameters=dict(n_epochs=1), method=dict(
                                                 type="supervised", supervised=dict(hyperparameters=dict(n_epochs=2))))
    assert caught.value.body["param"] == "hyperparameters"
    assert await count_jobs(db) == before


async def test_the_largest_rank_is_the_deployments_max_lora_rank(settings, db, temporal_client, default_key):
    """The API reads the engines' max_lora_rank (BALLAST_MAX_LORA_RANK, which an engine
    worker hands vLLM) from the same settings: a rank refused under 8 is taken under 16."""
    file_id = None
    for max_rank, accepted in ((8, False), (16, True)):
        async with build(settings.model_copy(update=dict(max_lora_rank=max_rank)), db, temporal_client,
                         default_key) as http:
            async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", max_retries=0, http_client=http,
                                          api_key=default_key) as c:
                file_id = file_id or await upload(c)
                create = c.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id,
                                                   hyperparameters=dict(lora_rank=16))
                if accepted:
                    assert (await create).hyperparameters.model_dump()["lora_rank"] == 16
                else:
                    with pytest.raises(openai.BadRequestError, match="LoRA ranks up to 8"):
                        await create
