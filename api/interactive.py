"""/v1/chat/completions and /v1/completions: interactive requests, streamed or not.

The path of a request, one step per function: check it (`protocol.requests`) → admit it
(`api/services/admission.py`: the tenant's limits against a local, bounded-stale view of usage; a
429 here happens before any engine work) → place it on an engine worker (local,
bounded-stale view) and open its token stream there, correcting the reservation to the
prompt's real size → relay the stream (SSE) or collect it (JSON) → release the
reservation the moment it ends, however it ends (done, failed, client gone). A request
the engine accepted is then handed, with its outcome, to this process's window
(api/services/settlement.py), which a workflow on the control worker journals with the
other requests that ended in it: Temporal is never between the client and a token, and
one request's bookkeeping does not hold up the next one's first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.deps import PrincipalDep, Services, ServicesDep
from api.errors import APIError
from api.request_ids import request_id
from api.services.admission import Ticket
from api.services.placer import Prompt
from journal import finetune_store
from journal.tenant_store import Principal
from policy.admission import Refuse, describe, estimate
from policy.placement import EngineView
from policy.pools import base_model, downgrade
from protocol import engine_wire, keys, responses, schema
from protocol.embeddings import EmbeddingRequest, wrong_task
from protocol.errors import ProtocolError
from protocol.requests import CHAT, COMPLETIONS, GenerationRequest, RequestLimits, parse
from protocol.temporal import InteractiveInput, RequestOutcome, RequestStatus
from protocol.tiers import GRANTED, RANK, Tier
from telemetry import families, tracing

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
# Up to this many characters a prompt is tokenized on the event loop (tens of microseconds:
# less than a thread hop); a longer one in a thread (a 1 MiB body takes ~100 ms).
INLINE_PROMPT_CHARS = 16_384

# The handlers read the raw body (`parse` judges it, as it judges batch lines), so
# /openapi.json gets the request schema from `protocol.schema`.
@router.post("/chat/completions", operation_id="createChatCompletion", responses=schema.generation_responses(),
             openapi_extra=schema.request_body(schema.chat_request()))
async def chat_completions(request: Request, svc: ServicesDep, who: PrincipalDep):
    return await _serve(request, svc, who, CHAT)


@router.post("/completions", operation_id="createCompletion", responses=schema.generation_responses(),
             openapi_extra=schema.request_body(schema.completions_request()))
async def completions(request: Request, svc: ServicesDep, who: PrincipalDep):
    return await _serve(request, svc, who, COMPLETIONS)


async def _serve(request: Request, svc: Services, who: Principal, endpoint: str):
    tenant = who.tenant
    t0 = time.perf_counter()
    body = await read_body(request)
    # The model's pool: its own limits, quotas and engines. A model no pool serves is
    # checked against the deployment's own, which names it in its 404.
    models = await svc.models()
    pool = base_model(body.get("model"), models) or svc.settings.model_name
    if pool == body.get("model") and (wrong := wrong_task(pool, pool in await svc.embedding_models(), endpoint)):
        raise APIError.of(wrong)
    req = parse(endpoint, body, RequestLimits(pool, models[pool], adapters=await _fine_tuned(svc, tenant, body, pool),
                                              others=tuple(m for m in models if m != pool)))
    if isinstance(req, ProtocolError):
        raise APIError.of(req)
    if req.service_tier in GRANTED and req.service_tier not in who.tiers:
        # Not granted: it runs as everyone's does, and its response's service_tier says so
        # (as OpenAI's do for a tier the project lacks).
        req = dataclasses.replace(req, service_tier=Tier.DEFAULT.value)
    asked = pool
    if req.service_tier == Tier.FLEX.value and pool == body.get("model") and svc.settings.flex_downgrade:
        pool, body, req = await _downgraded(svc, tenant, endpoint, body, req, pool, models)
    rid = ("chatcmpl-" if req.endpoint == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
    # Its ids, as the engine will count them (none until the tokenizer loads): they size the
    # reservation exactly. A long prompt is tokenized in a thread, so it never holds up the
    # other requests this process is serving.
    prompt = (await asyncio.to_thread(svc.placer.prompt, req, pool) if _chars(req) > INLINE_PROMPT_CHARS
              else svc.placer.prompt(req, pool))
    input_tokens, _ = estimate(req, models[pool], prompt.tokens)
    ticket = await admit(svc, tenant, req, pool, rid, input_tokens, counted=prompt.tokens is not None,
                         max_tokens=req.max_tokens, choices=req.n)
    try:
        run = await open_stream(svc, tenant, req, pool, body, t0, rid, ticket, weight=who.weight, regions=who.regions,
                          prompt=prompt, http_id=request_id(request))
    except BaseException:
        if ticket is not None:
            ticket.cancel()  # no engine took it: nothing used, all refunded
        raise
    if pool != asked:
        run.record = dataclasses.replace(run.record, downgraded_from=asked)
    response = _Streamed(run, _relay(run, req)) if req.stream else await _collect(run, req)
    if pool != asked:
        response.headers["x-ballast-downgraded-from"] = asked
    return response


def _chars(req: GenerationRequest) -> int:
    if req.endpoint == CHAT:
        return sum(len(m.content) for m in req.messages)
    return len(req.prompt)


async def _fine_tuned(svc: Services, tenant: str, body: dict[str, Any], pool: str) -> frozenset[str]:
    """{model} where it is one of the tenant's fine-tuned models (one query, for those only)."""
    model = body.get("model")
    if not isinstance(model, str) or not model.startswith(keys.fine_tuned_prefix(pool)):
        return frozenset()
    async with svc.db.connect() as conn:
        return frozenset([model]) if await finetune_store.owns_model(conn, tenant, model) else frozenset()


# -- 1. the body --------------------------------------------------------------------


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()  # bounded by the body-size middleware
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The request body nests JSON too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_request")
    return body


# -- 2. admission ----------------------------------------------------------------------


async def admit(svc: Services, tenant: str, req: GenerationRequest | EmbeddingRequest, pool: str, rid: str,
                input_tokens: int, *, counted: bool, max_tokens: int | None, choices: int) -> Ticket | None:
    """Reserve the request's tokens against the tenant's limits, or refuse it with a 429
    naming the limit. `input_tokens` are the prompt's size, `counted` where tokenized here
    as the engine will (else an estimate, corrected once the engine reports it)."""
    if svc.admission is None:
        return None
    busy = req.service_tier == Tier.FLEX.value and await _fleet_busy(svc, pool, tenant)
    got = await svc.admission.reserve(rid, tenant, pool, req.service_tier, input_tokens, max_tokens,
                                      fleet_busy=busy, counted=counted, choices=choices)
    if isinstance(got, Refuse):
        families.ADMISSION.labels(families.tenant(tenant), req.service_tier, pool, "refused", got.limit).inc()
        raise APIError(429, describe(got, tenant, pool, req.service_tier),
                       code="resource_unavailable" if got.limit == "capacity" else "rate_limit_exceeded",
                       headers={"Retry-After": str(got.retry_after_s)})
    families.ADMISSION.labels(families.tenant(tenant), req.service_tier, pool, "admitted", "").inc()
    return got


async def _fleet_busy(svc: Services, pool: str, tenant: str = "") -> bool:
    return _busy(await svc.engines.live(), pool, tenant, svc.settings.surge_high)


def _busy(engines: list[EngineView], pool: str, tenant: str, surge_high: float) -> bool:
    """Every engine serving the model is busy with interactive work (at the fleet's surge
    threshold) and already holds flex's floor in flex requests: flex yields first, but
    continuous chat cannot shut it out (below its floor it is admitted, and waits its turn
    at the engine, which gives flex its minimum share back). Never for a tenant with a
    reserved slot unused in the pool: placement sends it there."""
    views = [v for v in engines if v.model == pool]
    return (bool(views) and not any(tenant in v.reserved_free for v in views)
            and all(v.interactive >= surge_high * v.max_seqs and v.flex >= v.flex_floor for v in views))


async def _downgraded(svc: Services, tenant: str, endpoint: str, body: dict[str, Any], req: GenerationRequest,
                      pool: str, models: dict[str, int]) -> tuple[str, dict[str, Any], GenerationRequest]:
    """(pool, body, request) of a flex request: the configured smaller model's where its own
    pool is busy (policy.pools.downgrade) and the request fits that model too; else as asked."""
    engines, embedding = await svc.engines.live(), await svc.embedding_models()
    generating = {m: n for m, n in models.items() if m not in embedding}
    small = downgrade(pool, req.service_tier, svc.settings.flex_downgrade, generating,
                      lambda p: _busy(engines, p, tenant, svc.settings.surge_high))
    if small is None:
        return pool, body, req
    moved = {**body, "model": small}
    smaller = parse(endpoint, moved, RequestLimits(small, models[small], others=tuple(m for m in models if m != small)))
    if isinstance(smaller, ProtocolError):  # it does not fit the smaller model: shed as asked
        return pool, body, req
    families.ADMISSION.labels(families.tenant(tenant), req.service_tier, pool, "downgraded", small).inc()
    return small, moved, smaller


# -- 3. placement and the engine's stream -------------------------------------------


@dataclass
class OpenRequest:
    """One accepted request: its engine stream, and what its workflow records."""

    svc: Services
    record: InteractiveInput
    meta: dict[str, Any]
    lines: AsyncIterator[str]
    upstream: httpx.Response
    t0: float
    ticket: Ticket | None = None
    seqs: int = 1  # vLLM sequences it runs (its `n`), as placement counts load
    tokens: int = 0  # completion tokens streamed so far
    done: bool = False  # finished: its outcome is on its way to the journal

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_tokens

    async def events(self) -> AsyncGenerator[tuple[engine_wire.Delta | None, engine_wire.Finished | None], None]:
        """(delta, None) while generating, then (None, the final line). Raises
        EngineFailed when the engine reports a failure or the stream breaks."""
        try:
            async for ln in self.lines:
                try:
                    msg = engine_wire.decode(ln)
                except ValueError as err:
                    raise EngineFailed("The engine worker sent a line this API cannot read.") from err
                if isinstance(msg, engine_wire.Failed):
                    raise EngineFailed(msg.message, msg)
                if isinstance(msg, engine_wire.Finished):
                    yield None, msg
                    return
                if isinstance(msg, engine_wire.Delta):
                    self.tokens += msg.tokens
                    yield msg, None
            raise EngineFailed("The engine worker ended the stream early.")
        except httpx.HTTPError as err:
            raise EngineFailed(f"The engine worker's stream broke ({type(err).__name__}).") from err
        finally:
            await self.upstream.aclose()

    async def whole(self, seen: Callable[[engine_wire.Delta], None] = lambda _: None,
                    ) -> tuple[engine_wire.Finished, float | None]:
        """The stream to its end, each delta `seen`: its final line and TTFT. Ended any other
        way, the request is finished here: a failure raised as its APIError, a client gone
        (the handler cancelled) as cancelled."""
        final, ttft = None, None
        try:
            async for delta, end in self.events():
                if delta is not None:
                    ttft = ttft or self.ttft()
                    seen(delta)
                final = end or final
        except EngineFailed as err:
            self.finished(None, ttft, "failed")
            raise err.api_error() from err
        except BaseException:
            self.finished(None, ttft, "cancelled")
            raise
        assert final is not None  # events() ends with it or raises
        return final, ttft

    def finished(self, final: engine_wire.Finished | None, ttft: float | None,
                 status: RequestStatus | None = None) -> None:
        """Once, however the request ended: release its reservation now, journal the outcome
        in the background. A request cut short records the tokens it had produced."""
        if self.done:
            return
        self.done = True
        self.svc.placer.done(self.record.engine_id, self.seqs)
        if final is None:
            outcome = RequestOutcome(status or "cancelled", self.tokens, ttft_ms=ttft)
        else:
            outcome = RequestOutcome("completed", final.completion_tokens, final.finish_reason, ttft,
                                     final.engine_ttft_ms)
        if self.ticket is not None:
            self.ticket.release(self.prompt_tokens, outcome.completion_tokens)
        _observe(self.record, outcome, time.perf_counter() - self.t0)
        self.svc.settlement.add(dataclasses.replace(self.record, outcome=outcome), self.ticket)

    async def abandon(self) -> None:
        """The client left before the relay ran (or while it waited to send): close the
        engine's stream and finish as cancelled. Nothing once finished."""
        if self.done:
            return
        await self.upstream.aclose()  # the engine accepted it: it has a record like any other
        self.finished(None, None, "cancelled")

    def ttft(self) -> float:
        return round(1000 * (time.perf_counter() - self.t0), 2)


class EngineFailed(Exception):
    """The engine's failure; `refused`: it refused the request (a 4xx of vLLM's, before any
    token), which the client gets as that, not as an engine fault."""

    def __init__(self, message: str, refused: engine_wire.Failed | None = None):
        super().__init__(message)
        self.refused = refused if refused is not None and 400 <= refused.status < 500 else None

    def api_error(self) -> APIError:
        if self.refused is not None:
            e = self.refused.error
            return APIError(self.refused.status, str(self), param=e.get("param"), code=e.get("code"))
        return APIError(502, str(self), code="engine_error")


def _observe(r: InteractiveInput, outcome: RequestOutcome, seconds: float) -> None:
    """The request in this process's metrics, once it has ended (telemetry/families.py)."""
    tenant = families.tenant(r.tenant)
    families.REQUESTS.labels(tenant, r.tier, r.model, r.endpoint, outcome.status).inc()
    families.TOKENS.labels(tenant, r.tier, r.model, "prompt").inc(r.prompt_tokens)
    families.TOKENS.labels(tenant, r.tier, r.model, "completion").inc(outcome.completion_tokens)
    families.DURATION.labels(r.tier, r.model, outcome.status).observe(seconds)
    if outcome.ttft_ms is not None:
        ttft = outcome.ttft_ms / 1000
        families.TTFT.labels(r.tier, r.model).observe(ttft)
        if outcome.completion_tokens > 1:
            families.TPOT.labels(r.tier, r.model).observe(max(0.0, seconds - ttft) / (outcome.completion_tokens - 1))


async def open_stream(svc: Services, tenant: str, req: GenerationRequest | EmbeddingRequest, pool: str,
                      body: dict[str, Any], t0: float, rid: str, ticket: Ticket | None = None, weight: int = 1,
                      regions: frozenset[str] | None = None, prompt: Prompt | None = None,
                      http_id: str | None = None) -> OpenRequest:
    # tenant/tier/weight: the engine worker orders requests by tenant fair share within a tier
    # (engine/fair_share.py); `priority` stays for engine workers that predate it. The weight
    # is the tenant's as of its key's lookup (cached for BALLAST_KEY_CACHE_S).
    job = engine_wire.EngineJob(rid, req.endpoint, body, RANK[req.service_tier], tenant, req.service_tier, weight,
                                svc.placer.me, http_id)
    engine, upstream, lines, first = await _connect(svc, job, req, pool, regions, prompt)
    if not isinstance(first, engine_wire.Accepted):
        svc.placer.done(engine.id, req.n)
        await upstream.aclose()
        if upstream.status_code == 401:  # a deployment error, not the client's: say so where operators look
            log.error("engine %s refused the engine token (401): BALLAST_ENGINE_TOKEN differs between the API "
                      "and that engine worker", engine.id)
        if not isinstance(first, engine_wire.Failed):
            raise APIError(502, "The engine worker did not accept the request; try again.", code="engine_error")
        e = first.error
        raise APIError(first.status, first.message, param=e.get("param"), code=e.get("code"))
    record = InteractiveInput(rid, tenant, req.service_tier, pool, req.endpoint, engine.id,
                              first.prompt_tokens, http_request_id=http_id)
    if ticket is not None:
        ticket.correct(first.prompt_tokens)  # the engine's count replaces the estimate
        record = dataclasses.replace(record, reserved_input=ticket.input_tokens, reserved_output=ticket.output_tokens,
                                     holder=ticket.holder, admitted_at=ticket.at)
    meta = dict(id=rid, created=int(time.time()), model=req.model, service_tier=req.service_tier)
    return OpenRequest(svc, record, meta, lines, upstream, t0, ticket, seqs=req.n)


async def _connect(svc: Services, job: engine_wire.EngineJob, req: GenerationRequest | EmbeddingRequest, pool: str,
                   regions: frozenset[str] | None = None, prompt: Prompt | None = None,
                   ) -> tuple[EngineView, httpx.Response, AsyncIterator[str], engine_wire.Line | None]:
    """Open the stream on the best engine (api/services/placer.py) inside the tenant's regions:
    the engine, its response, its lines and the first of them (None where unreadable; an engine
    sends it once the request has its slot there, or refuses it). One that went away since it
    last announced itself is skipped for the next best; one that refused it for the wait (its
    queue is past the tier's bound) too, and where all of them did, that is the answer: 429,
    with the soonest Retry-After of theirs."""
    # The engine token (BALLAST_ENGINE_TOKEN): engine workers serve no one else.
    token = svc.settings.engine_token.get_secret_value().strip() if svc.settings.engine_token else ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Where traces are on, the request's span's traceparent: the engine worker's span is its child.
    headers.update(tracing.headers())
    ranked, blocks = svc.placer.rank(req, await svc.engines.live(), regions, prompt, pool, job.tenant)
    soonest: int | None = None  # the soonest Retry-After of the engines that refused it for the wait
    for engine in ranked:
        try:
            request = svc.http.build_request("POST", engine.url + "/v1/generate", json=job.to_json(), headers=headers)
            upstream = await svc.http.send(request, stream=True)
        except httpx.TransportError as e:
            log.warning("engine %s unreachable (%s); trying the next", engine.id, type(e).__name__)
            continue
        svc.placer.sent(engine, blocks, req.n)
        lines = upstream.aiter_lines()
        try:
            first = engine_wire.decode(await anext(lines)) if upstream.status_code == 200 else None
        except (httpx.HTTPError, StopAsyncIteration, ValueError):  # JSONDecodeError is a ValueError
            first = None
        if not (isinstance(first, engine_wire.Failed) and first.retry_after_s is not None):
            return engine, upstream, lines, first
        svc.placer.done(engine.id, req.n)
        await upstream.aclose()
        soonest = first.retry_after_s if soonest is None else min(soonest, first.retry_after_s)
    if soonest is not None:
        families.ADMISSION.labels(families.tenant(job.tenant), req.service_tier, pool, "refused", "wait").inc()
        raise APIError(429, f"Every engine serving {pool!r} is full, and the requests queued ahead of this one "
                            f"would keep it waiting past the bound on the {req.service_tier} tier's wait; try again in "
                            f"{soonest} s.", code="resource_unavailable", headers={"Retry-After": str(soonest)})
    where = f" in your regions ({', '.join(sorted(regions))})" if regions is not None else ""
    raise APIError(503, f"No engine worker is serving {pool!r}{where} right now; start `ballast worker engine`"
                        f"{' there' if where else ''}.", code="engine_unavailable", headers={"Retry-After": "5"})


# -- 4. relay or collect ------------------------------------------------------------


class _Streamed(StreamingResponse):
    """The SSE response. However the client goes, the run finishes once: the relay's own
    `finally` finishes it, and where the relay never ran (the client left first) or was
    left waiting at a `yield`, closing it here does."""

    def __init__(self, run: OpenRequest, relay: AsyncGenerator[bytes, None]):
        super().__init__(relay, media_type="text/event-stream")
        self.run, self.relay = run, relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.aclose()
            await self.run.abandon()


async def _relay(run: OpenRequest, req: GenerationRequest) -> AsyncGenerator[bytes, None]:
    each = [responses.Chunks(req.endpoint, run.meta, req.logprobs, index=i) for i in range(req.n)]  # by choice
    events = run.events()
    final, ttft = None, None
    status: RequestStatus | None = None
    try:
        for chunks in each:
            if opening := chunks.start():
                yield opening
        async for delta, end in events:
            if delta is not None:
                ttft = ttft or run.ttft()
                chunks = each[delta.choice]
                if delta.message is None:
                    yield chunks.text(delta.text, delta.logprobs)
                elif shown := chunks.message(delta.message, delta.logprobs):
                    yield shown
            else:
                final = end
        assert final is not None
        for chunks, ending in zip(each, final.endings(), strict=True):
            yield chunks.finish(ending.finish_reason)
        if req.include_usage:
            yield each[0].usage(run.prompt_tokens, final.completion_tokens, final.cached_tokens)
        yield responses.done()
    except EngineFailed as err:
        status = "failed"
        e = err.api_error()
        yield chunks.error(e.status, e.message, e.code)
    finally:
        # Also when the client goes away mid-stream: closing the events aborts the engine side.
        await events.aclose()
        run.finished(final, ttft, status)


async def _collect(run: OpenRequest, req: GenerationRequest) -> JSONResponse:
    text: list[list[str]] = [[] for _ in range(req.n)]  # by choice
    positions: list[list[Any]] = [[] for _ in range(req.n)]

    def seen(delta: engine_wire.Delta) -> None:
        text[delta.choice].append(delta.text)
        positions[delta.choice] += delta.logprobs or []

    final, ttft = await run.whole(seen)
    run.finished(final, ttft)
    choices = []
    for i, ending in enumerate(final.endings()):
        parsed = ending.message or {}  # where its tool calls were read: what the parser made of the text
        choices.append(responses.Choice(parsed.get("content", "".join(text[i])), ending.finish_reason,
                                        responses.shaped_logprobs(req.endpoint, positions[i] if req.logprobs is not None
                                                                  else None, req.logprobs), parsed.get("tool_calls")))
    return JSONResponse(responses.completion(req.endpoint, run.meta, choices, run.prompt_tokens,
                                             final.completion_tokens, cached_tokens=final.cached_tokens))
