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

import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import uvicorn
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import sampling, text
from engine.adapters import AdapterMissing
from engine.fair_share import FairShare
from engine.slots import EngineSlots
from protocol import engine_wire as wire
from protocol.errors import ProtocolError, error_body, storable
from protocol.requests import RequestLimits, parse
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
        req = parse(job.endpoint, job.body, RequestLimits(engine.spec.name, engine.spec.max_model_len,
                                                          any_adapter=True))
        ready = req if isinstance(req, ProtocolError) else sampling.prepare(engine, req)
        if isinstance(ready, ProtocolError):
            span.set_attribute("error.type", ready.code)
            span.end()
            return JSONResponse(asdict(wire.Failed(ready.body()["error"], ready.status_code)))
        prompt, params = ready.prompt, ready.sampling

        async def lines():
            ids: list[int] = []
            reason, ttft, cached = None, None, None
            try:
                yield wire.encode(wire.Accepted(len(prompt)))
                try:
                    # Counted before vLLM sees it: batch yields its slots first.
                    async with (slots.interactive_request(job.api),
                                fair.turn(job.tenant, job.tier, job.weight, len(prompt), job.priority) as turn):
                        async for step in engine.generate(job.request_id, prompt, params, priority=turn.priority,
                                                          detokenize=True, trace_headers=tracing.headers(span) or None):
                            if cached is None:
                                cached = step.cached_tokens
                            positions = None
                            if step.logprobs is not None:  # decoded in the context of the tokens before
                                context = ids[-text.CONTEXT:]  # all it reads: not a copy of every token per step
                                positions = text.decode_alternatives(engine.tokenizer, context + step.token_ids,
                                                                     step.logprobs, len(context))
                            ids += step.token_ids
                            turn.produced(len(step.token_ids))
                            reason = step.finish_reason
                            if step.text or step.token_ids:
                                ttft = ttft or round(1000 * (time.perf_counter() - t0), 2)
                                yield wire.encode(wire.Delta(step.text, len(step.token_ids), positions))
                except AdapterMissing as err:  # a fine-tuned model whose adapter is gone
                    yield _failed(404, str(err), "model", "model_not_found")
                    return
                except Exception as err:  # the client gets an error event, not a cut stream
                    if isinstance(err, ValueError) and not ids:  # vLLM refused it (a schema xgrammar cannot compile)
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
                yield wire.encode(wire.Finished(reason or "stop", len(ids), ttft,
                                                round(1000 * (time.perf_counter() - t0), 2), cached))
            finally:  # however it ended, the API gone mid-stream included
                log.info("served %s (x-request-id %s) of %s/%s: %d prompt + %d completion tokens, %s",
                         job.request_id, job.http_request_id or "-", tenant, tier, len(prompt), len(ids),
                         reason or "unfinished",
                         extra=dict(request_id=job.http_request_id, interactive_id=job.request_id, tenant=tenant,
                                    tier=tier, model=engine.spec.name, status=reason or "unfinished",
                                    prompt_tokens=len(prompt), completion_tokens=len(ids),
                                    duration_ms=round(1000 * (time.perf_counter() - t0), 1)))
                span.set_attributes({"gen_ai.usage.input_tokens": len(prompt), "gen_ai.usage.output_tokens": len(ids),
                                     "gen_ai.response.finish_reasons": [reason or "unfinished"]})
                span.end()
                if served is not None:
                    served(dict(request_id=job.request_id, tenant=tenant, tier=tier, model=engine.spec.name,
                                endpoint=job.endpoint, prompt_tokens=len(prompt), completion_tokens=len(ids),
                                finish_reason=reason, http_request_id=job.http_request_id))

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def stats(_: Request):
        # Live, for operators and tests: each batch hold's item stream and its tokens so
        # far (journaled + produced), and what the test gate holds when it is on.
        live = dict(slots.snapshot(), holds={h.id: h.generated for h in slots.holds.values()},
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


def _failed(status: int, message: str, param: str | None, code: str) -> bytes:
    return wire.encode(wire.Failed(error_body(status, message, param, code)["error"], status))


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside the worker's event loop; the worker, not uvicorn, owns signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
