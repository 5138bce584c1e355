"""One trace, from the client through every process: a chat sent with the client's own
`traceparent` and x-request-id through the real API, engine worker (vLLM) and control worker
processes, each exporting its spans by OTLP/HTTP (BALLAST_OTLP_ENDPOINT) to the tests'
receiver, which decodes them with the official protobuf definitions.

The trace is one tree under the client's span: the API's request span (carrying the client's
request id), the engine worker's generation span under it (over the NDJSON hop's traceparent),
vLLM's own llm_request span under that. The request's journaling is done once for its
window's requests: the API's `settle requests` span links to the request's span, and the
window's workflow is one trace under it (the Temporal SDK's interceptor: its start in the
API, its run and its activity on the control worker)."""

from __future__ import annotations

import json
import secrets
import time
import uuid

import pytest

from tests.e2e.conftest import WAIT_S, own_stack
from tests.e2e.otlp_receiver import Span, receiving

pytestmark = pytest.mark.e2e

API, ENGINE, CONTROL = "ballast-api", "ballast-engine", "ballast-control"
WANTED = {(API, "POST /v1/chat/completions"), (ENGINE, "engine.generate"), (ENGINE, "llm_request")}
WINDOW = {(API, "settle requests"), (API, "StartWorkflow:RequestWindow"), (CONTROL, "RunWorkflow:RequestWindow"),
          (CONTROL, "RunActivity:journal_window")}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, pg_server_url, temporal_address, tiny_model):
    # Exported every 0.2 s rather than every 5 s. The stack stops before the receiver: what a
    # process still holds at its exit arrives too.
    with receiving() as receiver, own_stack(tmp_path_factory, pg_server_url, temporal_address, tiny_model, "traces",
                                            BALLAST_OTLP_ENDPOINT=receiver.url,
                                            OTEL_BSP_SCHEDULE_DELAY="200") as (stack, _):
        yield stack, receiver


def named(spans: list[Span], service: str, name: str) -> Span:
    (span,) = [s for s in spans if (s.service, s.name) == (service, name)]
    return span


def ancestors(span: Span, spans: list[Span]) -> list[str]:
    """The span ids above `span`, nearest first, up to the one its trace does not hold (the client's)."""
    by_id, up = {s.span_id: s for s in spans}, []
    while span.parent_id is not None:
        up.append(span.parent_id)
        if span.parent_id not in by_id:
            break
        span = by_id[span.parent_id]
    return up


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_from_the_client_through_every_process(traced, tiny_model, stream):
    stack, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    mine = f"client-{uuid.uuid4().hex}"
    with stack.http() as api:
        r = api.post("/v1/chat/completions", json=dict(model=tiny_model.name, max_tokens=4, stream=stream,
                                                      messages=[dict(role="user", content="hi")]),
                     headers={"x-request-id": mine, "traceparent": f"00-{trace_id}-{client_span}-01"})
    assert r.status_code == 200 and r.headers["x-request-id"] == mine
    chat_id = (json.loads(r.text.split("data: ", 2)[1].split("\n")[0]) if stream else r.json())["id"]

    def whole(spans: list[Span]) -> bool:
        """Every span wanted, and one tree under the client's span: each span's parent has come too."""
        return (WANTED <= {(s.service, s.name) for s in spans}
                and all(ancestors(s, spans)[-1] == client_span for s in spans))

    spans = receiver.wait(trace_id, whole, WAIT_S)
    request = named(spans, API, "POST /v1/chat/completions")
    assert request.parent_id == client_span and request.kind == 2  # SERVER
    assert request.attributes["ballast.request_id"] == mine
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["http.route"] == request.attributes["url.path"] == "/v1/chat/completions"

    generation = named(spans, ENGINE, "engine.generate")
    assert request.span_id in ancestors(generation, spans)
    assert generation.attributes["ballast.request_id"] == mine
    assert generation.attributes["gen_ai.response.id"] == chat_id
    assert (generation.attributes["ballast.tenant"], generation.attributes["gen_ai.request.model"]) == (
        "default", tiny_model.name)
    assert generation.attributes["gen_ai.usage.output_tokens"] == 4
    assert generation.attributes["gen_ai.usage.input_tokens"] > 0

    # vLLM's own span of the request, under the engine worker's.
    llm = named(spans, ENGINE, "llm_request")
    assert llm.parent_id == generation.span_id and llm.attributes["gen_ai.request.id"] == chat_id
    assert llm.attributes["gen_ai.usage.completion_tokens"] == 4

    # Its window's workflow: started by the API under a span linked to the request's, run on the control worker.
    deadline = time.monotonic() + WAIT_S
    while not (linking := receiver.linking(trace_id, request.span_id)):
        assert time.monotonic() < deadline, "no span links to the request's"
        time.sleep(0.1)
    [settle] = linking
    assert settle.name == "settle requests" and settle.service == API and settle.attributes["ballast.requests"] >= 1
    window = receiver.wait(settle.trace_id, lambda got: WINDOW <= {(s.service, s.name) for s in got}, WAIT_S)
    start = named(window, API, "StartWorkflow:RequestWindow")
    assert start.parent_id == settle.span_id
    for name in ("RunWorkflow:RequestWindow", "RunActivity:journal_window"):
        assert start.span_id in ancestors(named(window, CONTROL, name), window)

    # Whatever else the stack sent (vLLM's engine processes' own spans included) names its service.
    assert {s.service for s in receiver.spans} == {API, ENGINE, CONTROL}


def test_a_batch_is_one_trace_from_its_creation_to_vllm(traced, tiny_model):
    """A batch's trace begins with the API's span of its creation; its workflow's runs and
    activities join it, the engine worker's generation activity included, and vLLM's span
    of each item's generation is that activity's child."""
    stack, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    line = dict(custom_id="c0", method="POST", url="/v1/chat/completions",
                body=dict(model=tiny_model.name, max_tokens=4, messages=[dict(role="user", content="hi")]))
    with stack.http() as api:
        file_id = api.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line) + "\n")},
                           data={"purpose": "batch"}).json()["id"]
        batch = api.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                  completion_window="24h"),
                         headers={"traceparent": f"00-{trace_id}-{client_span}-01"}).json()
        deadline = time.monotonic() + WAIT_S
        while (batch := api.get(f"/v1/batches/{batch['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline and batch["status"] in ("validating", "in_progress", "finalizing"), batch
            time.sleep(0.3)

    wanted = {(API, "POST /v1/batches"), (API, "StartWorkflow:Batch"), (CONTROL, "RunWorkflow:Batch"),
              (ENGINE, "RunActivity:generate"), (ENGINE, "llm_request")}

    def whole(spans: list[Span]) -> bool:
        return (wanted <= {(s.service, s.name) for s in spans}
                and all(ancestors(s, spans)[-1] == client_span for s in spans))

    spans = receiver.wait(trace_id, whole, WAIT_S)
    created = named(spans, API, "POST /v1/batches")
    assert created.parent_id == client_span and created.attributes["http.response.status_code"] == 200
    # The interceptor hangs a workflow's run and its activities under the span of its start.
    start = named(spans, API, "StartWorkflow:Batch")
    assert created.span_id in ancestors(start, spans)
    assert start.span_id in ancestors(named(spans, CONTROL, "RunWorkflow:Batch"), spans)
    generation = named(spans, ENGINE, "RunActivity:generate")
    assert start.span_id in ancestors(generation, spans)
    assert named(spans, ENGINE, "llm_request").parent_id == generation.span_id
