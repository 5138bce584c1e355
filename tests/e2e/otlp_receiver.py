"""A trace collector for the tests: an OTLP/HTTP receiver (POST /v1/traces, protobuf bodies)
that decodes each export with the official protobuf definitions (`opentelemetry-proto`'s
ExportTraceServiceRequest) and keeps every span, with the service that sent it. What sends
to it are the real OpenTelemetry SDK's exporters, in the processes under test."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Span:
    trace_id: str  # 32 hex digits, as in a traceparent
    span_id: str  # 16 hex digits
    parent_id: str | None  # None: the root of its trace (in this receiver's view)
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 is SERVER, 3 CLIENT
    service: str  # the sending process's resource service.name
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id) of each span it links to


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind is not None else None


def decode(body: bytes) -> list[Span]:
    """Every span of one OTLP/HTTP protobuf export."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex() or None, s.name, s.kind,
                                  str(resource.get("service.name", "")),
                                  {kv.key: _value(kv.value) for kv in s.attributes}, resource,
                                  [(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))
    return spans


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != PROTOBUF:
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                try:
                    spans = decode(body)
                except Exception:  # not an ExportTraceServiceRequest: the exporter's bug, say so
                    self.send_error(400)
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", PROTOBUF)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def linking(self, trace_id: str, span_id: str) -> list[Span]:
        """The spans (of any trace) that link to this one."""
        with self._lock:
            return [s for s in self.spans if (trace_id, span_id) in s.links]

    def wait(self, trace_id: str, until: Callable[[list[Span]], bool], timeout: float = 60) -> list[Span]:
        """The spans of `trace_id` received once `until(spans)`; fails with what came after `timeout`."""
        deadline = time.monotonic() + timeout
        while not until(spans := self.trace(trace_id)):
            assert time.monotonic() < deadline, [(s.service, s.name) for s in spans]
            time.sleep(0.1)
        return spans


@contextmanager
def receiving() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r._server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r._server.shutdown()
        r._server.server_close()
