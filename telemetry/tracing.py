"""Traces: OpenTelemetry spans, exported by OTLP/HTTP to BALLAST_OTLP_ENDPOINT, one trace per
request from the API (a SERVER span, continuing the client's `traceparent`) through the engine
worker (the W3C `traceparent` header on the hop to it, engine/server.py) into vLLM (its own
spans, given the same headers) and Temporal (the SDK's tracing interceptor, config/temporal.py).

Each process installs its provider once, at start (`setup`), named by its `service.name`:
ballast-api, ballast-engine, ballast-control. Unset, nothing is installed: `server_span`
hands back the invalid span, on which every call does nothing, and `headers` is empty."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from config.telemetry import TelemetrySettings

# W3C Trace Context alone (traceparent, tracestate): what crosses a process here, whatever
# propagators the environment configures.
W3C = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def setup(service: str, settings: TelemetrySettings) -> bool:
    """This process's tracer provider, exporting to `settings.otlp_endpoint` as `service`;
    nothing where that is unset. Before anything makes a tracer: vLLM, started later in an
    engine worker, then finds it installed and its spans go the same way. Whether traces are on."""
    global _provider, _tracer
    if _provider is not None or not settings.otlp_endpoint:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    # A trace that starts here is kept at the ratio; one that arrives keeps its caller's decision.
    _provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}), shutdown_on_exit=False,
                               sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)))
    # Off the request path: a span ended is queued, and a thread of the processor's own exports
    # them in batches (every OTEL_BSP_SCHEDULE_DELAY ms, 5000 by default).
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    _tracer = _provider.get_tracer("ballast")
    # And the providers of the processes this one starts (vLLM's engine core and workers,
    # which export their own spans) name the same service.
    os.environ.setdefault("OTEL_SERVICE_NAME", service)
    # The global one too: the Temporal SDK's interceptor and vLLM make their spans with it.
    trace.set_tracer_provider(_provider)
    atexit.register(shutdown)
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Export what is still queued and stop (at exit, on its own)."""
    if _provider is not None:
        _provider.shutdown()


def server_span(name: str, headers: Mapping[str, str], attributes: Mapping[str, AttributeValue]) -> Span:
    """A SERVER span, started, not made current: a child of the caller's span where `headers`
    carry its `traceparent`, else the root of a new trace. The caller ends it. Off: the invalid span."""
    if _tracer is None:
        return INVALID_SPAN
    return _tracer.start_span(name, context=W3C.extract(headers), kind=SpanKind.SERVER, attributes=attributes)


def headers(span: Span | None = None) -> dict[str, str]:
    """The W3C headers (`traceparent`, and `tracestate` where there is one) that make what
    another process does with a request a child of `span`, else of the current span. Empty
    where tracing is off, or where there is no span to continue."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    W3C.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def current() -> SpanContext | None:
    """The current span's context, to link to later (None where tracing is off or there is none)."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


@contextmanager
def linked(name: str, links: Sequence[SpanContext | None], attributes: Mapping[str, AttributeValue]) -> Iterator[None]:
    """A span of its own, current inside, linked to each of `links`: work done once for many
    requests (a window's journaling) is reachable from each request's trace, not inside any."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(name, context=trace.set_span_in_context(INVALID_SPAN),
                                       links=[Link(c) for c in links if c is not None], attributes=attributes):
        yield
