"""GET /healthz: 200 only when every part a request needs is ready.

Open to anyone (probes carry no key), so it must cost little and say little: the parts are
checked at most once per CACHE_S however many ask (they share one check), and the answer
is the status alone. A tenant's key also gets each part's state and the tokenizer's; an
admin key also gets why a part is down (error text names hosts and ports).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from api.deps import Services, ServicesDep
from api.errors import APIError
from api.services.auth import authenticate
from policy.pools import pool_queue

router = APIRouter()
CACHE_S = 1.0


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


async def _parts(svc: Services) -> dict[str, str]:
    s = svc.settings
    return dict(
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


async def _shared(svc: Services) -> dict[str, str]:
    """The parts' states, checked at most once per CACHE_S: every caller meanwhile shares
    that one check (shielded: a caller that goes away does not cancel it for the others)."""
    cache = svc.health
    if "task" not in cache or time.monotonic() - cache["at"] > CACHE_S:
        cache.update(at=time.monotonic(), task=asyncio.ensure_future(_parts(svc)))
    return await asyncio.shield(cache["task"])


@router.get("/healthz")
async def healthz(request: Request, svc: ServicesDep):
    parts = await _shared(svc)
    ok = all(v == "ok" for v in parts.values())
    body: dict = dict(status="ok" if ok else "unavailable")
    header = request.headers.get("authorization")
    try:
        who = await authenticate(svc.keys, header) if header else None
    except APIError:
        who = None  # a bad or uncheckable key: what anyone gets, never a 401 (probes carry none)
    if who is not None:
        body["parts"] = parts if who.admin else {k: v.split(":", 1)[0] for k, v in parts.items()}
        # Not a part: without it requests still serve, placed by load, their sizes estimated.
        body["tokenizer"] = "loaded" if svc.placer.has_tokenizer else \
            "not loaded: placing by load, estimating prompt sizes"
    return JSONResponse(body, status_code=200 if ok else 503)
