"""/v1/fine_tuning/jobs: create, retrieve, list, cancel, pause, resume, events and
checkpoints (OpenAI's fine-tuning API shape; pause and resume as OpenAI's too).

A job is journaled (`ft_job_created`) and its workflow started on the control queue; the
file is checked there (`validating_files`), before any step trains. Cancel, pause and
resume are signals: the running chunk checkpoints, then the job moves.

Hyperparameters come as OpenAI's `hyperparameters` or `method.supervised.hyperparameters`
(supervised fine-tuning is what trains here); beside OpenAI's own, `lora_rank`, `lora_alpha`
and `lora_target_modules` choose the LoRA adapter, each refused with a 400 naming itself
when it is not one this deployment trains and serves (a rank above the engines'
max_lora_rank). Whether the model has the target modules is known where it is loaded: a
job naming one it lacks fails at its first chunk, saying which.
"""

from __future__ import annotations

import logging
import random
import re
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from api.deps import Services, ServicesDep, TenantDep
from api.errors import APIError, check_metadata, check_text, not_found, possible_id, require_id
from journal import batch_store, finetune_store, ledger, tenant_store
from policy.admission import Refuse, admit_fine_tune, describe_fine_tune
from policy.pools import pool_queue
from protocol import keys
from protocol.finetune import LORA_ALPHA, LORA_RANK, LORA_TARGETS, lora_problem
from protocol.limits import ANY_MODEL
from protocol.schema import errors
from protocol.temporal import FineTuneInput
from workflows.finetune import FineTuneWorkflow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/fine_tuning/jobs")

BASE_LEARNING_RATE = 1e-3  # × learning_rate_multiplier: the tiny model's LoRA learns at this rate
DEFAULTS: dict[str, Any] = dict(n_epochs=3, batch_size=1, learning_rate_multiplier=1.0,  # "auto"
                                lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_target_modules=list(LORA_TARGETS))
LORA = ("lora_rank", "lora_alpha", "lora_target_modules")
_SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Hyperparameters(BaseModel):
    n_epochs: int | Literal["auto"] = Field("auto")
    batch_size: int | Literal["auto"] = Field("auto")
    learning_rate_multiplier: float | Literal["auto"] = Field("auto")
    # Ballast's extensions: the LoRA adapter the job trains.
    lora_rank: int | Literal["auto"] = Field("auto", description=(
        f"The adapter's rank: a power of two up to the engines' max_lora_rank ({LORA_RANK} when auto)."))
    lora_alpha: float | Literal["auto"] = Field("auto", description=(
        f"The adapter's scale is lora_alpha / lora_rank ({LORA_ALPHA:g} when auto)."))
    lora_target_modules: list[str] | Literal["auto"] = Field("auto", description=(
        f"The linear layers the adapter trains, by module name ({', '.join(LORA_TARGETS)} when auto)."))

    # Taken as given and checked in `_hyperparameters`, so that a bad one is refused naming
    # itself (`hyperparameters.lora_rank`); the schema still says what they are.
    @field_validator("lora_rank", mode="plain", json_schema_input_type=int | Literal["auto"])
    @classmethod
    def _rank(cls, value: Any) -> Any:
        return value

    @field_validator("lora_alpha", mode="plain", json_schema_input_type=float | Literal["auto"])
    @classmethod
    def _alpha(cls, value: Any) -> Any:
        return value

    @field_validator("lora_target_modules", mode="plain", json_schema_input_type=list[str] | Literal["auto"])
    @classmethod
    def _targets(cls, value: Any) -> Any:
        return value


class Supervised(BaseModel):
    hyperparameters: Hyperparameters | None = None


class Method(BaseModel):
    """OpenAI's `method`: supervised fine-tuning is what trains here."""
    type: Literal["supervised"]
    supervised: Supervised | None = None


class CreateJob(BaseModel):
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    suffix: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


async def _admit(conn: AsyncConnection, tenant: str, model: str) -> None:
    """Refuse a job over the tenant's `concurrent_fine_tunes` (429, as OpenAI's limit on
    active jobs). Counted and created in one transaction, one creation per tenant at a
    time (a transaction-scoped advisory lock): two at once cannot both take the last place."""
    await conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"fine-tune-admission:{tenant}"))))
    sets = (await ledger.load_limits(conn, tenant)).get(tenant, ())
    scopes = [(s, await finetune_store.active_jobs(conn, tenant, None if s.model == ANY_MODEL else model))
              for s in sets if s.model in (ANY_MODEL, model) and s.concurrent_fine_tunes is not None]
    decision = admit_fine_tune(scopes)
    if isinstance(decision, Refuse):
        raise APIError(429, describe_fine_tune(decision, tenant, model), code="rate_limit_exceeded",
                       headers={"Retry-After": str(decision.retry_after_s)})




def job_object(row: dict[str, Any], svc: Services, latest: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's job object; `latest`, the job's newest checkpoint, dates its estimated finish.
    Beside OpenAI's fields, `ballast.workflow_url`: the job's workflow in the Temporal UI."""
    hp = row["hyperparameters"]
    return dict(object="fine_tuning.job", id=row["id"], model=row["model"], created_at=row["created_at"],
                finished_at=row["finished_at"], fine_tuned_model=row["fine_tuned_model"], organization_id=row["tenant"],
                status=row["status"], error=row["error"], training_file=row["training_file"],
                validation_file=row["validation_file"], result_files=row["result_files"],
                trained_tokens=row["trained_tokens"], seed=row["seed"], user_provided_suffix=row["suffix"],
                metadata=row["metadata"], integrations=[],
                estimated_finish=finetune_store.estimated_finish(row["status"], latest, time.time()),
                hyperparameters=dict(n_epochs=hp["n_epochs"], batch_size=hp["batch_size"],
                                     learning_rate_multiplier=hp["learning_rate_multiplier"],
                                     **{k: hp[k] for k in LORA if k in hp}),  # jobs from before LoRA's: none
                ballast=dict(workflow_url=svc.settings.workflow_url(keys.ftjob(row["id"]))))


def _links(*operations: str) -> dict:
    return {200: {"description": "The fine-tuning job.", "links": {
        op: {"operationId": op, "parameters": {"fine_tuning_job_id": "$response.body#/id"}} for op in operations}}}


def _given(body: CreateJob) -> tuple[Hyperparameters | None, str]:
    """The job's hyperparameters and where they were given (the param an error names)."""
    inside = body.method.supervised if body.method is not None and body.method.supervised is not None else None
    if inside is not None and inside.hyperparameters is not None:
        if body.hyperparameters is not None:
            raise APIError(400, "Give hyperparameters or method.supervised.hyperparameters, not both.",
                           param="hyperparameters", code="invalid_value")
        return inside.hyperparameters, "method.supervised.hyperparameters"
    return body.hyperparameters, "hyperparameters"


def _hyperparameters(h: Hyperparameters | None, max_lora_rank: int, where: str = "hyperparameters") -> dict[str, Any]:
    """What the job stores: every hyperparameter, "auto" as its default. `max_lora_rank`:
    the largest rank this deployment's engines serve."""
    given = {k: getattr(h, k) for k in DEFAULTS} if h else {}  # as given: LoRA's are checked below
    out = {k: DEFAULTS[k] if given.get(k, "auto") == "auto" else given[k] for k in DEFAULTS}
    if not 1 <= out["n_epochs"] <= 50:
        raise APIError(400, "n_epochs must be between 1 and 50.", param=f"{where}.n_epochs",
                       code="invalid_value")
    if not 1 <= out["batch_size"] <= 256:
        raise APIError(400, "batch_size must be between 1 and 256.", param=f"{where}.batch_size",
                       code="invalid_value")
    if not 0 < out["learning_rate_multiplier"] <= 10:
        raise APIError(400, "learning_rate_multiplier must be above 0 and at most 10.",
                       param=f"{where}.learning_rate_multiplier", code="invalid_value")
    for name in LORA:
        if problem := lora_problem(name, out[name], max_lora_rank):
            raise APIError(400, problem, param=f"{where}.{name}", code="invalid_value")
    out["lora_alpha"], out["lora_target_modules"] = float(out["lora_alpha"]), list(out["lora_target_modules"])
    out["learning_rate"] = BASE_LEARNING_RATE * out["learning_rate_multiplier"]
    return out


@router.post("", operation_id="createFineTuningJob",
             responses=_links("retrieveFineTuningJob", "cancelFineTuningJob") | errors(400, 404, 429, 503))
async def create(body: CreateJob, svc: ServicesDep, tenant: TenantDep):
    s = svc.settings
    models = await svc.models()  # a base model any pool serves: its engines train it, and serve the result
    embedding = await svc.embedding_models()  # their engines serve no adapters (vLLM's pooling runner)
    if body.model not in models or body.model in embedding:
        served = ", ".join(repr(m) for m in models if m not in embedding)
        raise APIError(400, f"Model {check_text(body.model, 'model')!r} is not available for fine-tuning; "
                            f"this deployment fine-tunes {served}.", param="model", code="model_not_available")
    if body.suffix is not None and not _SUFFIX.fullmatch(body.suffix):
        raise APIError(400, "suffix is 1 to 64 characters of letters, digits, '-' and '_'.", param="suffix",
                       code="invalid_value")
    check_metadata(body.metadata)
    given, where = _given(body)
    hyper = _hyperparameters(given, s.max_lora_rank, where)
    now = int(time.time())
    row: dict[str, Any] = dict(
        id="ftjob-" + uuid.uuid4().hex[:24], tenant=tenant, model=body.model, training_file=body.training_file,
        validation_file=body.validation_file, hyperparameters=hyper,
        seed=body.seed if body.seed is not None else random.SystemRandom().randrange(2**31),
        suffix=body.suffix, metadata=body.metadata, status="validating_files", error=None, fine_tuned_model=None,
        trained_tokens=None, result_files=[], created_at=now, finished_at=None)
    async with svc.db.begin() as conn:
        for param in ("training_file", "validation_file"):
            file_id = getattr(body, param)
            if file_id is None:
                continue
            require_id("file", file_id, param)
            # Not expired, and held until the job is journaled (a DELETE then sees it in use).
            f = await batch_store.get_file(conn, file_id, tenant, now=now, lock=True)
            if f is None:
                raise not_found("file", file_id, param)
            if f["purpose"] != "fine-tune":
                raise APIError(400, f"File {file_id} has purpose {f['purpose']!r}; fine-tuning needs purpose "
                                    "'fine-tune'.", param=param, code="invalid_value")
        await _admit(conn, tenant, body.model)
        await finetune_store.create_job(conn, row)
        owner = await tenant_store.get_tenant(conn, tenant)
    try:
        await svc.temporal.start_workflow(
            FineTuneWorkflow.run,
            FineTuneInput(row["id"], pool_queue(s.engine_queue, body.model), s.fine_tune_chunk_steps,
                          s.heartbeat_timeout_s, tenant=tenant,
                          fairness_weight=float(owner["weight"] if owner else 1),
                          checkpoint_overhead=s.fine_tune_checkpoint_overhead, chunk_max_s=s.fine_tune_chunk_max_s),
            id=keys.ftjob(row["id"]), task_queue=s.control_queue,
            search_attributes=svc.attributes("fine_tune", tenant, body.model),
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE, id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    except Exception as err:  # the job must not sit in `validating_files` forever
        log.exception("could not start fine-tuning job %s", row["id"])
        async with svc.db.begin() as conn:
            await finetune_store.move_status(conn, row, "failed", finished_at=int(time.time()),
                                             error=dict(code="unavailable", message=f"could not start: {err}",
                                                        param=None))
        raise APIError(503, "The job could not be scheduled; try again shortly.", code="unavailable") from err
    return await _current(svc, row["id"])


async def _current(svc: Services, job_id: str) -> dict[str, Any]:
    async with svc.db.connect() as conn:
        row = await finetune_store.get_job(conn, job_id)
    assert row is not None, f"fine-tuning job {job_id} vanished"
    return job_object(row, svc)


async def _owned(svc: Services, job_id: str, tenant: str) -> dict[str, Any]:
    require_id("fine-tuning job", job_id, "fine_tuning_job_id")
    async with svc.db.connect() as conn:
        row = await finetune_store.get_job(conn, job_id, tenant)
    if row is None:
        raise not_found("fine-tuning job", job_id, "fine_tuning_job_id")
    return row


@router.get("/{fine_tuning_job_id}", operation_id="retrieveFineTuningJob", responses=errors(404))
async def retrieve(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep):
    row = await _owned(svc, fine_tuning_job_id, tenant)
    return job_object(row, svc, (await _latest(svc, [row]))[row["id"]])


@router.get("", operation_id="listFineTuningJobs", responses=errors(400))
async def list_(svc: ServicesDep, tenant: TenantDep, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    rows: list[dict[str, Any]] = []  # a cursor that cannot exist pages like one that does not
    if after is None or possible_id(after):
        async with svc.db.connect() as conn:
            rows = await finetune_store.list_jobs(conn, tenant, after, limit + 1)
    latest = await _latest(svc, rows[:limit])
    data = [job_object(r, svc, latest[r["id"]]) for r in rows[:limit]]
    return dict(object="list", data=data, has_more=len(rows) > limit)


async def _latest(svc: Services, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The newest checkpoint of each running job among `rows` (None for the others)."""
    found: dict[str, dict[str, Any]] = {}
    if running := [r["id"] for r in rows if r["status"] == "running"]:
        async with svc.db.connect() as conn:
            found = await finetune_store.latest_checkpoints(conn, running)
    return {r["id"]: found.get(r["id"]) for r in rows}


async def _signal(svc: Services, tenant: str, job_id: str, name: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    row = await _owned(svc, job_id, tenant)
    if row["status"] not in allowed:
        raise APIError(400, f"Cannot {name} a fine-tuning job with status {row['status']}.",
                       param="fine_tuning_job_id", code="invalid_state")
    try:
        await svc.temporal.get_workflow_handle(keys.ftjob(job_id)).signal(name)
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise APIError(503, f"The job could not be reached to {name} it; try again shortly.",
                           code="unavailable", headers={"Retry-After": "5"}) from err
        log.info("%s %s: no running workflow (%s)", name, job_id, err.message)
    return job_object(row, svc)


@router.post("/{fine_tuning_job_id}/cancel", operation_id="cancelFineTuningJob", responses=errors(400, 404, 503))
async def cancel(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep):
    """The job stops after the step in progress (checkpointed) and ends `cancelled`."""
    return await _signal(svc, tenant, fine_tuning_job_id, "cancel", ("validating_files", "queued", "running",
                                                                   "paused"))


@router.post("/{fine_tuning_job_id}/pause", operation_id="pauseFineTuningJob", responses=errors(400, 404, 503))
async def pause(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep):
    """The job stops after the step in progress (checkpointed) and waits `paused`."""
    return await _signal(svc, tenant, fine_tuning_job_id, "pause", ("validating_files", "queued", "running"))


@router.post("/{fine_tuning_job_id}/resume", operation_id="resumeFineTuningJob", responses=errors(400, 404, 503))
async def resume(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep):
    """A paused job goes on from its last checkpoint."""
    return await _signal(svc, tenant, fine_tuning_job_id, "resume", ("paused",))


@router.get("/{fine_tuning_job_id}/events", operation_id="listFineTuningEvents", responses=errors(404))
async def events(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep, after: str | None = None,
                 limit: int = Query(20, ge=1, le=100)):
    """Newest first, as OpenAI lists them."""
    await _owned(svc, fine_tuning_job_id, tenant)
    async with svc.db.connect() as conn:
        found = await finetune_store.job_events(conn, fine_tuning_job_id)
    out = [dict(object="fine_tuning.job.event", id=f"ftevent-{e['position']}", created_at=e["at"], level=e["level"],
                message=e["message"], type="message", data=e.get("data") or {}) for e in reversed(found)]
    if after is not None:
        ids = [e["id"] for e in out]
        out = out[ids.index(after) + 1:] if after in ids else []
    return dict(object="list", data=out[:limit], has_more=len(out) > limit)


@router.get("/{fine_tuning_job_id}/checkpoints", operation_id="listFineTuningCheckpoints", responses=errors(404))
async def checkpoints(fine_tuning_job_id: str, svc: ServicesDep, tenant: TenantDep, after: str | None = None,
                      limit: int = Query(10, ge=1, le=100)):
    """Newest first; each names the step, its training loss and its SHA-256."""
    row = await _owned(svc, fine_tuning_job_id, tenant)
    async with svc.db.connect() as conn:
        found = await finetune_store.checkpoints(conn, fine_tuning_job_id)
    out = [dict(object="fine_tuning.job.checkpoint", id=f"ftckpt-{c['position']}", created_at=c["at"],
                fine_tuning_job_id=row["id"], step_number=c["step"],
                fine_tuned_model_checkpoint=f"{finetune_store.fine_tuned_name(row)}:ckpt-step-{c['step']}",
                metrics=dict(step=c["step"], train_loss=c["losses"][-1] if c["losses"] else None),
                sha256=c["sha256"]) for c in reversed(found)]
    if after is not None:
        ids = [c["id"] for c in out]
        out = out[ids.index(after) + 1:] if after in ids else []
    return dict(object="list", data=out[:limit], first_id=out[0]["id"] if out else None,
                last_id=out[min(limit, len(out)) - 1]["id"] if out else None, has_more=len(out) > limit)
