"""Traces (telemetry/tracing.py): off, nothing is installed and nothing is made; on, the W3C
headers carry a span's context from one process to the next, the API's request span and the
engine worker's generation span continue it, and a process exports its spans by OTLP/HTTP
(to the tests' receiver, which decodes them with the official protobuf definitions).

In process, the spans go to an in-memory exporter (`traced`), never to the global provider,
which stays the OpenTelemetry API's stand-in for every other test here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as Exported
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import config.temporal
from api.request_ids import RequestId
from config.telemetry import TelemetrySettings
from config.temporal import TemporalSettings, connect_temporal
from engine.server import create_app
from engine.slots import EngineSlots
from telemetry import tracing
from tests.e2e.otlp_receiver import receiving
from tests.engine.test_server import JOB, TOKEN, FakeEngine

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def traced(monkeypatch) -> InMemorySpanExporter:
    """Tracing on in this process, its spans kept in memory."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("ballast"))
    return spans


def test_off_nothing_is_installed_or_made():
    assert tracing.setup("ballast-api", TelemetrySettings(_env_file=None)) is False
    assert not tracing.enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # the API's stand-in, still
    span = tracing.server_span("engine.generate", {"traceparent": TRACEPARENT}, {"ballast.tenant": "acme"})
    assert span is trace.INVALID_SPAN and not span.is_recording()
    assert tracing.headers() == {} and tracing.headers(span) == {}


def test_the_w3c_headers_round_trip(traced):
    api = tracing.server_span("POST /v1/chat/completions", {"traceparent": TRACEPARENT}, {})
    ctx = api.get_span_context()
    assert (f"{ctx.trace_id:032x}", f"{api.parent.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    sent = tracing.headers(api)
    assert sent == {"traceparent": f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"}
    engine = tracing.server_span("engine.generate", sent, {})
    assert engine.get_span_context().trace_id == ctx.trace_id and engine.parent.span_id == ctx.span_id
    with trace.use_span(engine, end_on_exit=True):
        assert tracing.headers()["traceparent"].split("-")[2] == f"{engine.get_span_context().span_id:016x}"
    api.end()
    assert [s.name for s in traced.get_finished_spans()] == ["engine.generate", "POST /v1/chat/completions"]
    # No traceparent: the root of a trace of its own.
    assert tracing.server_span("GET /healthz", {}, {}).parent is None


async def test_the_apis_request_span(traced):
    app = FastAPI()

    @app.get("/v1/batches/{batch_id}")
    async def batch(batch_id: str):
        return {"id": batch_id, "traceparent": tracing.headers().get("traceparent")}

    @app.get("/healthz")
    async def healthz():
        return {}

    app.add_middleware(RequestId)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://api.test") as http:
        r = await http.get("/v1/batches/batch_1", headers={"x-request-id": "client-1", "traceparent": TRACEPARENT})
        await http.get("/nowhere")
        await http.get("/healthz")  # probes make no traces
    (span, missing) = traced.get_finished_spans()
    assert span.name == "GET /v1/batches/{batch_id}" and span.kind == SpanKind.SERVER  # the route, never an id
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    assert dict(span.attributes) == {"http.request.method": "GET", "url.path": "/v1/batches/batch_1",
                                     "ballast.request_id": "client-1", "http.route": "/v1/batches/{batch_id}",
                                     "http.response.status_code": 200}
    # Current while the handler runs: what it sends on continues the request's span.
    assert r.json()["traceparent"] == f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01"
    assert missing.name == "GET" and missing.attributes["http.response.status_code"] == 404


async def test_the_engine_workers_generation_span(traced):
    class Engine(FakeEngine):
        async def generate(self, request_id, prompt, sampling, trace_headers=None, **kw):
            self.trace_headers = trace_headers
            async for step in super().generate(request_id, prompt, sampling, **kw):
                yield step

    engine = Engine()
    app = create_app(engine, EngineSlots(4), token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine.test") as http:
        r = await http.post("/v1/generate", json=dict(JOB, http_request_id="client-7"),
                            headers={"Authorization": f"Bearer {TOKEN}", "traceparent": TRACEPARENT})
    assert r.status_code == 200
    (span,) = traced.get_finished_spans()
    assert span.name == "engine.generate" and span.kind == SpanKind.SERVER
    assert span.parent.span_id == int(CLIENT_SPAN, 16) and span.context.trace_id == int(CLIENT_TRACE, 16)
    assert dict(span.attributes) == {
        "ballast.tenant": "acme", "ballast.tier": "default", "gen_ai.request.model": "ballast-tiny",
        "gen_ai.response.id": "req-1", "ballast.request_id": "client-7", "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 2, "gen_ai.response.finish_reasons": ("length",)}
    # vLLM's span of the request is the generation span's child.
    assert engine.trace_headers == {"traceparent": f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01"}


async def test_temporal_clients_carry_the_sdks_interceptor_where_a_provider_is_installed(monkeypatch):
    from temporalio.contrib.opentelemetry import TracingInterceptor

    calls = []

    async def fake_connect(target_host, **kwargs):
        calls.append(kwargs)

    monkeypatch.setattr(config.temporal.Client, "connect", fake_connect)
    settings = TemporalSettings(_env_file=None, temporal_address="temporal.test:7233")
    await connect_temporal(settings)
    monkeypatch.setattr(config.temporal.trace, "get_tracer_provider", lambda: TracerProvider())
    await connect_temporal(settings)
    assert "interceptors" not in calls[0]
    assert [type(i) for i in calls[1]["interceptors"]] == [TracingInterceptor]


EXPORTING = textwrap.dedent("""
    from config.telemetry import TelemetrySettings
    from telemetry import tracing

    assert tracing.setup("ballast-test", TelemetrySettings(_env_file=None))
    tracing.server_span("followed", {"traceparent": %r}, {"ballast.request_id": "client-9"}).end()
    tracing.server_span("sampled out", {}, {}).end()
    # No shutdown called: the process's exit exports what is queued.
""")


def test_a_process_exports_its_spans_by_otlp_http_at_the_sample_ratio():
    """A real process, the SDK's exporter, the official protobuf decoding. At ratio 0 a trace
    that starts here is dropped; one a caller sent sampled is kept."""
    with receiving() as receiver:
        env = dict(os.environ, BALLAST_OTLP_ENDPOINT=receiver.url, BALLAST_TRACE_SAMPLE_RATIO="0")
        subprocess.run([sys.executable, "-c", EXPORTING % TRACEPARENT], env=env, check=True, timeout=60)
        (span,) = receiver.spans
    assert (span.trace_id, span.parent_id, span.name, span.service) == (CLIENT_TRACE, CLIENT_SPAN, "followed",
                                                                        "ballast-test")
    assert span.kind == Exported.SPAN_KIND_SERVER and span.attributes == {"ballast.request_id": "client-9"}
