"""GET /healthz: 200 only when every part a request needs is ready."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from api.deps import ServicesDep
from policy.pools import pool_queue

router = APIRouter()


async def _pollers(svc, queue: str, kind) -> int:
    req = DescribeTaskQueueRequest(namespace=svc.temporal.namespace, task_queue=TaskQueue(name=queue),
                                   task_queue_type=kind)
    return len((await svc.temporal.workflow_service.describe_task_queue(req, timeout=timedelta(seconds=2))).pollers)


async def _check(coro) -> str:
    try:
        ok = await asyncio.wait_for(coro, 3)
    except Exception as err:
        return f"down: {type(err).__name__}: {err}"[:200]
    return "ok" if ok else "down: no worker polling"


async def _db(svc) -> bool:
    async with svc.db.connect() as conn:
        return (await conn.execute(text("SELECT 1"))).scalar() == 1


async def _engines(svc) -> bool:
    return any(e.model == svc.settings.model_name and not e.draining for e in await svc.engines.live())


@router.get("/healthz")
async def healthz(svc: ServicesDep):
    s = svc.settings
    parts = dict(
        zip(
            ("postgres", "temporal_control_worker", "engine_worker", "engine_streaming"),
            await asyncio.gather(
                _check(_db(svc)),
                _check(_pollers(svc, s.control_queue, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW)),
                # The deployment's own model's pool takes its batches.
                _check(_pollers(svc, pool_queue(s.engine_queue, s.model_name), TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY)),
                _check(_engines(svc)),
            ),
            strict=True,
        )
    )
    ok = all(v == "ok" for v in parts.values())
    # Not a part: without it requests still serve, placed by load, their sizes estimated.
    tokenizer = "loaded" if svc.placer.has_tokenizer else "not loaded: placing by load, estimating prompt sizes"
    return JSONResponse(dict(status="ok" if ok else "unavailable", parts=parts, tokenizer=tokenizer),
                        status_code=200 if ok else 503)
