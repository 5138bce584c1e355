"""/v1/chat/completions and /v1/completions: interactive requests, streamed or not.

The path of a request: validate → place on an engine worker (local, bounded-stale view)
→ stream from the engine worker's NDJSON endpoint. Once the engine has accepted it, the
request's workflow is started eagerly in the background and signalled with the outcome at
the end: Temporal is never between the client and a token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from temporalio.common import WorkflowIDReusePolicy

from activities.batch_input import Limits, check_request
from api.deps import Services, ServicesDep, TenantDep
from api.errors import APIError
from engine.requests import CHAT
from policy.placement import EngineView, rank
from policy.preemption import TIERS
from workflows.inputs import InteractiveInput, RequestOutcome
from workflows.interactive import InteractiveWorkflow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

SERVICE_TIERS = ("priority", "default", "flex")
_background: set[asyncio.Task] = set()  # fire-and-forget work, kept referenced until done


def _spawn(coro) -> asyncio.Task:
    task = asyncio.create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


@router.post("/chat/completions")
async def chat_completions(request: Request, svc: ServicesDep, tenant: TenantDep):
    return await _serve(request, svc, tenant, CHAT)


@router.post("/completions")
async def completions(request: Request, svc: ServicesDep, tenant: TenantDep):
    return await _serve(request, svc, tenant, "/v1/completions")


async def _serve(request: Request, svc: Services, tenant: str, endpoint: str):
    t0 = time.perf_counter()
    body = await _body(request)
    s = svc.settings
    if err := check_request(endpoint, body, Limits(endpoint, s.model_name, s.max_model_len), interactive=True):
        raise APIError(err.status_code, err.message, param=err.param, code=err.code)
    tier = body.get("service_tier") or "default"
    tier = "default" if tier == "auto" else tier
    if tier not in SERVICE_TIERS:
        raise APIError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)} (or auto).", param="service_tier",
                       code="invalid_value")
    rid = ("chatcmpl-" if endpoint == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
    job = dict(request_id=rid, endpoint=endpoint, body=body, priority=TIERS[tier])
    engine, upstream = await _connect(svc, job)
    lines = upstream.aiter_lines()
    first = json.loads(await anext(lines)) if upstream.status_code == 200 else {"error": {"message": "engine error"}, "status": 502}
    if "error" in first:
        await upstream.aclose()
        e = first["error"]
        raise APIError(first["status"], e["message"], param=e.get("param"), code=e.get("code"))

    # Accepted. The request's workflow starts once the first token is on its way: its
    # start is cheap, but not free, and the first token must not wait for it.
    record = InteractiveInput(rid, tenant, tier, s.model_name, endpoint, engine.id, first["prompt_tokens"])
    started: list[asyncio.Task] = []
    meta = dict(id=rid, created=int(time.time()), model=s.model_name, service_tier=tier)

    async def tokens():
        """(text delta, None) while generating, then (None, final line)."""
        try:
            async for ln in lines:
                msg = json.loads(ln)
                if "finish_reason" in msg:
                    yield None, msg
                    return
                yield msg["text"], None
                if not started:
                    started.append(_spawn(_start_workflow(svc, record)))
        finally:
            if not started:
                started.append(_spawn(_start_workflow(svc, record)))
            await upstream.aclose()

    def outcome(final: dict | None, ttft: float | None) -> RequestOutcome:
        if final is None:
            return RequestOutcome("cancelled", ttft_ms=ttft)
        return RequestOutcome("completed", final["completion_tokens"], final["finish_reason"], ttft,
                              final.get("engine_ttft_ms"))

    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _sse(endpoint, meta, tokens(), first["prompt_tokens"], include_usage, t0,
                 lambda final, ttft: _finish(svc, started, outcome(final, ttft))),
            media_type="text/event-stream",
        )
    text, final, ttft = [], None, None
    async for delta, end in tokens():
        if delta is not None:
            ttft = ttft or round(1000 * (time.perf_counter() - t0), 2)
            text.append(delta)
        final = end or final
    _spawn(_finish(svc, started, outcome(final, ttft)))
    return JSONResponse(_completion(endpoint, meta, "".join(text), final, first["prompt_tokens"]))


async def _connect(svc: Services, job: dict) -> tuple[EngineView, httpx.Response]:
    """Open the stream on the best engine; one that went away since it last announced
    itself is skipped for the next best."""
    model = svc.settings.model_name
    for engine in rank(await svc.engines.live(), model):
        try:
            request = svc.http.build_request("POST", engine.url + "/v1/generate", json=job)
            return engine, await svc.http.send(request, stream=True)
        except httpx.TransportError as e:
            log.warning("engine %s unreachable (%s); trying the next", engine.id, type(e).__name__)
    raise APIError(503, f"No engine worker is serving {model!r} right now; start `ballast worker engine`.",
                   code="engine_unavailable", headers={"Retry-After": "5"})


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_request")
    return body


async def _start_workflow(svc: Services, record: InteractiveInput):
    return await svc.temporal.start_workflow(
        InteractiveWorkflow.run, record, id=f"request:{record.request_id}", task_queue=svc.settings.interactive_queue,
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE, request_eager_start=True,
    )


async def _finish(svc: Services, started: list[asyncio.Task], outcome: RequestOutcome) -> None:
    try:
        handle = await started[0]
        await handle.signal(InteractiveWorkflow.finished, outcome)
    except Exception:  # the response is already out; the workflow journals it as abandoned
        log.exception("could not record the outcome of a request")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion(endpoint: str, meta: dict, text: str, final: dict | None, prompt_tokens: int) -> dict:
    reason = (final or {}).get("finish_reason", "stop")
    n = (final or {}).get("completion_tokens", 0)
    if endpoint == CHAT:
        choice = dict(index=0, message=dict(role="assistant", content=text), finish_reason=reason, logprobs=None)
        return dict(meta, object="chat.completion", choices=[choice], usage=_usage(prompt_tokens, n))
    choice = dict(index=0, text=text, finish_reason=reason, logprobs=None)
    return dict(meta, object="text_completion", choices=[choice], usage=_usage(prompt_tokens, n))


async def _sse(endpoint, meta, tokens, prompt_tokens, include_usage, t0, on_done):
    chat = endpoint == CHAT
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> bytes:
        return b"data: " + json.dumps(dict(meta, object=obj, choices=choices, **extra), ensure_ascii=False).encode() + b"\n\n"

    def choice(text: str | None, reason: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return dict(index=0, delta=delta, finish_reason=reason, logprobs=None)
        return dict(index=0, text=text or "", finish_reason=reason, logprobs=None)

    final, ttft = None, None
    try:
        if chat:
            yield event([choice("", None, first=True)])
        async for delta, end in tokens:
            if delta is not None:
                ttft = ttft or round(1000 * (time.perf_counter() - t0), 2)
                yield event([choice(delta, None)])
            else:
                final = end
        yield event([choice(None, final["finish_reason"])])
        if include_usage:
            yield event([], usage=_usage(prompt_tokens, final["completion_tokens"]))
        yield b"data: [DONE]\n\n"
    finally:
        # Also when the client goes away mid-stream: closing `tokens` aborts the engine side.
        await tokens.aclose()
        _spawn(on_done(final, ttft))
