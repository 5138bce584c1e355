"""/v1/embeddings: served by the engines of an embedding model's pool (vLLM's pooling
runner), on the interactive path: checked (`protocol.embeddings`), admitted against the
tenant's limits for its input tokens (it generates none), placed, and accounted for as a
chat is (the engine's record and its API process's request window journal it; the ledger
settles its tokens). Nothing streams: the engine answers with every vector at once."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.deps import PrincipalDep, Services, ServicesDep
from api.errors import APIError
from api.interactive import INLINE_PROMPT_CHARS, OpenRequest, admit, open_stream, read_body
from api.request_ids import request_id
from api.services.placer import Prompt
from engine import embedding
from journal.tenant_store import Principal
from policy.admission import estimate_embedding
from protocol import embeddings, schema
from protocol.embeddings import EmbeddingRequest
from protocol.errors import ProtocolError
from protocol.requests import EMBEDDINGS, RequestLimits

router = APIRouter(prefix="/v1")


@router.post("/embeddings", operation_id="createEmbedding", responses=schema.embeddings_responses(),
             openapi_extra=schema.request_body(schema.embeddings_request()))
async def create_embeddings(request: Request, svc: ServicesDep, who: PrincipalDep):
    return await _serve(request, svc, who)


async def _serve(request: Request, svc: Services, who: Principal) -> JSONResponse:
    t0 = time.perf_counter()
    body = await read_body(request)
    models = await svc.models()
    named = body.get("model")
    pool = named if isinstance(named, str) and named in models else svc.settings.model_name
    req = embeddings.parse(body, RequestLimits(pool, models[pool], others=tuple(m for m in models if m != pool)))
    if isinstance(req, ProtocolError):
        raise APIError.of(req)
    if (wrong := embeddings.wrong_task(pool, pool in await svc.embedding_models(), EMBEDDINGS)) is not None:
        raise APIError.of(wrong)
    rid = "embd-" + uuid.uuid4().hex[:24]
    chars = sum(len(one) for one in req.inputs if isinstance(one, str))
    prompt, counted = await asyncio.to_thread(_counted, svc, req, pool) if chars > INLINE_PROMPT_CHARS \
        else _counted(svc, req, pool)
    ticket = await admit(svc, who.tenant, req, pool, rid, estimate_embedding(req, models[pool], counted),
                         counted=counted is not None, max_tokens=0, choices=0)
    try:
        run = await open_stream(svc, who.tenant, req, pool, body, t0, rid, ticket, weight=who.weight,
                                regions=who.regions, prompt=prompt, http_id=request_id(request))
    except BaseException:
        if ticket is not None:
            ticket.cancel()  # no engine took it: nothing used, all refunded
        raise
    return await _collect(run, req)


def _counted(svc: Services, req: EmbeddingRequest, pool: str) -> tuple[Prompt, int | None]:
    """The first input's ids (placement's prefix) and every input's tokens, as the engine
    will count them; nothing until the pool's tokenizer is loaded."""
    tok = svc.placer.tokenizer(pool)
    if tok is None:
        return Prompt(), None
    ids = embedding.token_ids(tok, req)
    return Prompt(tuple(ids[0]), whole=True), sum(map(len, ids))


async def _collect(run: OpenRequest, req: EmbeddingRequest) -> JSONResponse:
    final, _ = await run.whole()
    if final.embeddings is None or len(final.embeddings) != len(req.inputs):
        run.finished(None, None, "failed")
        raise APIError(502, "The engine worker answered without an embedding for every input.", code="engine_error")
    run.finished(final, None)  # no first token: embeddings stay out of the TTFT figures
    return JSONResponse(embeddings.response(req.model, final.embeddings, run.prompt_tokens, req.base64))

