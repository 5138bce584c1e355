"""The engine worker's streaming endpoint for interactive requests.

Interactive tokens must not cross Temporal (one history event per token, tens of ms per
dispatch), so the API streams them straight from the engine worker over HTTP, as NDJSON
lines (protocol/engine_wire.py: the job it is posted, the lines it streams back).

Interactive requests count against the engine's slots (`EngineSlots`), which is what makes
batch work yield to them within an engine step, and take their turn by tenant fair share
(`FairShare`, engine/fair_share.py): the job names its `tenant`, `tier` and `weight`, and the
engine worker sets the vLLM priority itself (a job without them: the API's `priority`).

Every request must carry the engine token (BALLAST_ENGINE_TOKEN, shared by the API and the
engine workers) as `Authorization: Bearer <token>`; anything else is answered 401 before a
byte of its body is read. Without it, whoever reaches this port would generate with no
tenant, no quota and no journal, and /stats would show who uses the engine and how much.
Only the probes, /healthz and /readyz, ask nothing; /metrics asks for the metrics token.

Where traces are on (telemetry/tracing.py), each generation is a span, "engine.generate", the
child of the API's request span whose `traceparent` the request carries; vLLM's own span of
the request (llm_request) is its child in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import uvicorn
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import embedding, sampling, text, tools
from engine.adapters import AdapterMissing
from engine.fair_share import FairShare, WaitedPastBound
from engine.slots import EngineSlots
from protocol import embeddings
from protocol import engine_wire as wire
from protocol.errors import ProtocolError, error_body, storable
from protocol.requests import EMBEDDINGS, RequestLimits, parse
from telemetry import exposition, health, tracing

log = logging.getLogger(__name__)


def create_app(engine, slots: EngineSlots, fair: FairShare | None = None, *, token: str,
               served: Callable[[dict], None] | None = None, metrics_token: str | None = None,
               polling: Callable[[], bool] = lambda: True) -> Starlette:
    """`token`: the engine token every request must present (never empty). `served`: told
    of every request once its stream ends, however it ends (journal/served.py).
    `metrics_token`: what /metrics asks for (None: /metrics is off). `polling`: whether the
    worker's Temporal workers run (for /readyz)."""
    if not token:
        raise ValueError("the engine endpoint needs a token (BALLAST_ENGINE_TOKEN)")
    fair = fair or FairShare("fcfs", slots.max_seqs)

    async def generate(request: Request):
        t0 = time.perf_counter()
        job = wire.EngineJob.from_json(await request.json())
        tenant, tier = job.tenant or "default", job.tier or "default"
        traced = {"ballast.tenant": tenant, "ballast.tier": tier, "gen_ai.request.model": str(job.body.get("model")),
                  "gen_ai.response.id": job.request_id}
        if job.http_request_id:
            traced["ballast.request_id"] = job.http_request_id
        span = tracing.server_span("engine.generate", request.headers, traced)

        def refused(why: ProtocolError) -> JSONResponse:
            span.set_attribute("error.type", why.code)
            span.end()
            return JSONResponse(asdict(wire.Failed(why.body()["error"], why.status_code)))

        def shed() -> JSONResponse | None:
            """Refused, before it is accepted, where it would wait past its tier's bound."""
            retry = fair.over_bound(tenant, job.tier)
            if retry is None:
                return None
            span.set_attribute("error.type", "resource_unavailable")
            span.end()
            message = (f"Every sequence slot on this engine is taken and the requests queued ahead of this one would "
                       f"keep it waiting past the bound on the {tier} tier's wait; try again in {retry} s.")
            return JSONResponse(asdict(wire.Failed(error_body(429, message, None, "resource_unavailable")["error"], 429,
                                                   retry)))

        limits = RequestLimits(engine.spec.name, engine.spec.max_model_len, any_adapter=True)
        if (wrong := embeddings.wrong_task(engine.spec.name, engine.spec.embeds, job.endpoint)) is not None:
            return refused(wrong)
        if job.endpoint == EMBEDDINGS:
            asked = embeddings.parse(job.body, limits)
            ids = asked if isinstance(asked, ProtocolError) else embedding.inputs(engine, asked)
            if isinstance(ids, ProtocolError):
                return refused(ids)
            assert not isinstance(asked, ProtocolError)  # else `ids` is that error
            if (busy := shed()) is not None:
                return busy
            return StreamingResponse(embed(job, asked, ids, span, t0), media_type="application/x-ndjson")
        req = parse(job.endpoint, job.body, limits)
        ready = req if isinstance(req, ProtocolError) else sampling.prepare(engine, req)
        if isinstance(ready, ProtocolError):
            return refused(ready)
        assert not isinstance(req, ProtocolError)  # else `ready` is that error
        if (busy := shed()) is not None:
            return busy
        prompt, params, calls = ready.prompt, ready.sampling, ready.calls
        # Each choice its own generation (seeded as vLLM's parallel sampling), and its own
        # tool parser: a streaming one keeps state.
        choices = [_Choice(calls)] + [_Choice(tools.Calls(engine, req) if calls else None) for _ in range(1, req.n)]

        async def lines():
            echo = req.echo  # the prompt goes first, with the first step (its prompt logprobs)
            ttft, cached, accepted = None, None, False
            try:
                try:
                    # Counted before vLLM sees it: batch yields its slots first. Accepted once
                    # it has its turn: generation starts now.
                    async with (slots.interactive_request(job.api, req.n),
                                fair.turn(job.tenant, job.tier, job.weight, len(prompt), job.priority) as turn):
                        accepted = True
                        yield wire.encode(wire.Accepted(len(prompt)))
                        echoed, each = None, params
                        if echo and req.n > 1 and params.prompt_logprobs is not None:
                            # Once, in a request of their own, not in each choice's.
                            echoed = await sampling.prompt_logprobs(engine, f"{job.request_id}-echo", prompt, params)
                            each = replace(params, prompt_logprobs=None)
                        async for index, step in _merged(engine, job.request_id, prompt, each, req.n,
                                                         priority=turn.priority, detokenize=True,
                                                         trace_headers=tracing.headers(span) or None):
                            c = choices[index]
                            if cached is None:
                                cached = step.cached_tokens
                            if echo:
                                echo = False
                                for i in range(req.n):  # every choice shows the prompt first
                                    yield wire.encode(wire.Delta(sampling.echo_text(engine, req, prompt), 0,
                                                                 echoed or step.prompt_logprobs, choice=i))
                            positions = None
                            if step.logprobs is not None:  # decoded in the context of the tokens before
                                context = c.ids[-text.CONTEXT:]  # all it reads: not a copy of every token per step
                                positions = text.decode_alternatives(engine.tokenizer, context + step.token_ids,
                                                                     step.logprobs, len(context))
                            c.ids += step.token_ids
                            turn.produced(len(step.token_ids))
                            c.reason = step.finish_reason
                            if req.max_tokens == 0:  # the prompt alone: vLLM's one token is counted, not shown
                                ttft = ttft or round(1000 * (time.perf_counter() - t0), 2)
                            elif step.text or step.token_ids:
                                ttft = ttft or round(1000 * (time.perf_counter() - t0), 2)
                                shown = None
                                if c.calls is not None and req.stream:
                                    shown = c.calls.delta(step.text, step.token_ids, prompt,
                                                          c.reason is not None) or {}
                                elif c.calls is not None:
                                    c.said.append(step.text)
                                yield wire.encode(wire.Delta(step.text, len(step.token_ids), positions, shown,
                                                             index))
                except WaitedPastBound as err:  # refused, never accepted: nothing to record
                    span.set_attribute("error.type", "resource_unavailable")
                    yield _failed(429, str(err), None, "resource_unavailable")
                    return
                except AdapterMissing as err:  # a fine-tuned model whose adapter is gone
                    yield _failed(404, str(err), "model", "model_not_found")
                    return
                except Exception as err:  # the client gets an error event, not a cut stream
                    # vLLM refused it (a schema xgrammar cannot compile)
                    if isinstance(err, ValueError) and not any(c.ids for c in choices):
                        yield _failed(400, storable(f"The engine refused the request: {err}"), None,
                                      "invalid_request")
                        return
                    log.exception("generation %s (x-request-id %s) failed", job.request_id, job.http_request_id)
                    span.record_exception(err)
                    span.set_status(StatusCode.ERROR)
                    yield _failed(500, f"The engine failed while generating: {type(err).__name__}.", None,
                                  "engine_error")
                    return
                # One uninterrupted run: text, finish reason and count are vLLM's own.
                ends = [c.end(req.stream) for c in choices]
                yield wire.encode(wire.Finished(ends[0].finish_reason, sum(e.completion_tokens for e in ends), ttft,
                                                round(1000 * (time.perf_counter() - t0), 2), cached, ends[0].message,
                                                ends if req.n > 1 else None))
            finally:  # however it ended, the API gone mid-stream included
                produced = sum(len(c.ids) for c in choices)
                reason = choices[0].reason if all(c.reason is not None for c in choices) else None
                span.set_attributes({"gen_ai.usage.input_tokens": len(prompt), "gen_ai.usage.output_tokens": produced,
                                     "gen_ai.response.finish_reasons": [reason or "unfinished"]})
                span.end()
                if accepted:  # else the API has no record of it either: refused, or the API left while it waited
                    log.info("served %s (x-request-id %s) of %s/%s: %d prompt + %d completion tokens, %s",
                             job.request_id, job.http_request_id or "-", tenant, tier, len(prompt), produced,
                             reason or "unfinished",
                             extra=dict(request_id=job.http_request_id, interactive_id=job.request_id, tenant=tenant,
                                        tier=tier, model=engine.spec.name, status=reason or "unfinished",
                                        prompt_tokens=len(prompt), completion_tokens=produced,
                                        duration_ms=round(1000 * (time.perf_counter() - t0), 1)))
                if accepted and served is not None:
                    served(dict(request_id=job.request_id, tenant=tenant, tier=tier, model=engine.spec.name,
                                endpoint=job.endpoint, prompt_tokens=len(prompt), completion_tokens=produced,
                                finish_reason=reason, http_request_id=job.http_request_id))

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def embed(job: wire.EngineJob, req: embeddings.EmbeddingRequest, ids: list[list[int]], span, t0: float):
        """An embeddings request's lines: accepted, then its vectors, all at once (nothing to
        stream). Its inputs count as interactive sequences, up to the engine's all."""
        tenant, tier, prompt_tokens = job.tenant or "default", job.tier or "default", sum(map(len, ids))
        vectors, accepted = None, False
        try:
            try:
                async with (slots.interactive_request(job.api, min(len(ids), slots.max_seqs)),
                            fair.turn(job.tenant, job.tier, job.weight, prompt_tokens, job.priority) as turn):
                    accepted = True
                    yield wire.encode(wire.Accepted(prompt_tokens))  # once it has its turn, as a generation's
                    vectors = await engine.embed(job.request_id, ids, dimensions=req.dimensions, priority=turn.priority,
                                                 trace_headers=tracing.headers(span) or None)
            except WaitedPastBound as err:  # refused, never accepted: nothing to record
                span.set_attribute("error.type", "resource_unavailable")
                yield _failed(429, str(err), None, "resource_unavailable")
                return
            except ValueError as err:  # what vLLM refuses: `dimensions` of a model without Matryoshka embeddings
                yield _failed(400, storable(f"The engine refused the request: {err}"),
                              "dimensions" if req.dimensions is not None else None, "invalid_request")
                return
            except Exception as err:
                log.exception("embeddings %s (x-request-id %s) failed", job.request_id, job.http_request_id)
                span.record_exception(err)
                span.set_status(StatusCode.ERROR)
                yield _failed(500, f"The engine failed while embedding: {type(err).__name__}.", None, "engine_error")
                return
            ms = round(1000 * (time.perf_counter() - t0), 2)
            yield wire.encode(wire.Finished("stop", 0, ms, ms, embeddings=vectors))
        finally:
            reason = "stop" if vectors is not None else None
            log.info("served %s (x-request-id %s) of %s/%s: %d inputs, %d prompt tokens, %s", job.request_id,
                     job.http_request_id or "-", tenant, tier, len(ids), prompt_tokens, reason or "unfinished")
            span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": 0})
            span.end()
            if accepted and served is not None:
                served(dict(request_id=job.request_id, tenant=tenant, tier=tier, model=engine.spec.name,
                            endpoint=job.endpoint, prompt_tokens=prompt_tokens, completion_tokens=0,
                            finish_reason=reason, http_request_id=job.http_request_id))

    async def stats(_: Request):
        # Live, for operators and tests: each batch hold's item stream and its tokens so
        # far (journaled + produced), and what the test gate holds when it is on.
        live = dict(slots.snapshot(), resume_after_s=round(slots.wait_s, 3),
                    holds={h.id: h.generated for h in slots.holds.values()},
                    fairness=fair.snapshot(), yields=[[id, round(s, 4)] for id, s in slots.stats.yields])
        if (gate := getattr(engine, "gate_stats", None)) is not None:
            live["gate"] = gate()
        return JSONResponse(live)

    async def metrics(_: Request):
        return Response(await exposition.render(), media_type=exposition.CONTENT_TYPE)

    async def healthz(_: Request):
        return JSONResponse(dict(status="ok"))

    async def readyz(_: Request):
        body, status = health.readiness(dict(vllm=await health.part(engine.check_health()),
                                             workers="ok" if polling() else "down: not polling"))
        return JSONResponse(body, status_code=status)

    return Starlette(routes=[Route("/v1/generate", generate, methods=["POST"]), Route("/stats", stats),
                             Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz)],
                     middleware=[Middleware(RequireToken, token=token, metrics_token=metrics_token)])


# The probes (/healthz: the process answers; /readyz: vLLM lives and the worker polls its
# task queues), open to an orchestrator's kubelet, which holds no secret: they name no
# tenant and no work.
OPEN = frozenset({"/healthz", "/readyz"})


class RequireToken:
    """Outermost: a request without the engine token is answered 401 before the app, and
    so before anything reads its body. Compared in constant time. /metrics asks for the
    metrics token instead (Prometheus holds that one, never the engine token), and is 404
    where there is none; the probes (OPEN) ask nothing."""

    def __init__(self, app: ASGIApp, token: str, metrics_token: str | None = None):
        self.app, self.token, self.metrics_token = app, token.encode(), metrics_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in OPEN:  # the probes: what they say names no tenant and no work
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/metrics":
            if no := exposition.refusal(Headers(scope=scope).get("authorization"), self.metrics_token):
                await JSONResponse(error_body(no.status, no.message, None, no.code), status_code=no.status,
                                   headers=no.headers)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        scheme, _, presented = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            why = "Missing engine token: send Authorization: Bearer <BALLAST_ENGINE_TOKEN>."
        elif not hmac.compare_digest(presented.strip().encode(), self.token):
            why = "Invalid engine token: it differs from this engine worker's BALLAST_ENGINE_TOKEN."
        else:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error_body(401, why, None, "invalid_engine_token"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class _Choice:
    """One choice of a request as it streams: its tokens, its tool parser, its end."""

    def __init__(self, calls):
        self.calls = calls
        self.ids: list[int] = []
        self.said: list[str] = []  # the whole text, where its tool calls are read at the end
        self.reason: str | None = None

    def end(self, streamed: bool) -> wire.Ending:
        ending, message = self.reason or "stop", None
        if self.calls is not None and streamed:
            ending = self.calls.stream_reason(ending)
        elif self.calls is not None:
            whole = self.calls.whole("".join(self.said), ending)
            ending, message = whole.finish_reason, dict(content=whole.content, tool_calls=whole.tool_calls)
        return wire.Ending(ending, len(self.ids), message)


async def _merged(engine, request_id: str, prompt: list[int], params: sampling.Sampling, n: int, **kw):
    """(choice, step) of each of `n` generations as they come; closing it (or a failure of
    one) aborts them all."""
    if n == 1:
        async for step in engine.generate(request_id, prompt, params, **kw):
            yield 0, step
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def run(i: int) -> None:
        try:
            async for step in engine.generate(f"{request_id}-{i}", prompt, sampling.choice(params, i), **kw):
                queue.put_nowait((i, step))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(run(i)) for i in range(n)]
    try:
        for _ in range(n):
            while (got := await queue.get())[1] is not None:
                yield got
            await tasks[got[0]]  # its failure, if it failed, is the request's
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _failed(status: int, message: str, param: str | None, code: str) -> bytes:
    return wire.encode(wire.Failed(error_body(status, message, param, code)["error"], status))


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside the worker's event loop; the worker, not uvicorn, owns signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
