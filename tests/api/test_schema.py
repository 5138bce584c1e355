"""Schemathesis over /openapi.json: no client input is answered with a server error, input
the schema calls invalid is a 4xx, every answer is one the spec documents (status, media
type, body schema: errors in OpenAI's shape), and chains of calls that follow the spec's
links (upload → create batch → retrieve → cancel) answer 2xx or 4xx all the way.

In process, as the other API tests: the app on real Postgres and a real Temporal dev
server, with a control queue no worker polls (batches stay `validating`; cancelling one
still answers), with a tenant's key (not an admin's: the admin routes answer 403). No
engine is live, so a valid chat or completions body is a 503 engine_unavailable: the one
5xx allowed, for those two operations only.

Schemathesis and Hypothesis are synchronous and the app lives on pytest's event loop, so
the examples run in a worker thread and each request crosses back to the loop (`_OnLoop`,
a `requests` transport). Derandomized: the same examples every run.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
import urllib3
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from config import Settings
from protocol import requests as rules
from protocol import schema as documented
from tests.api.conftest import build

BASE = "http://ballast.test"
MODEL = "ballast-tiny"
SPEC = create_app(Settings(served_model_name=MODEL)).openapi()
CONFIG = SchemathesisConfig.from_dict({
    "base-url": BASE,
    # Invalid data must be refused with a 4xx (schemathesis' default also accepts any 5xx).
    "checks": {"negative_data_rejection": {"expected-statuses": ["4XX"]}},
    # Stateful runs follow the spec's own links, not ones schemathesis would guess.
    "phases": {"stateful": {"inference": {"algorithms": []}}},
})
SCHEMA = schemathesis.openapi.from_dict(SPEC, config=CONFIG)
GENERATION = ("createChatCompletion", "createCompletion")
LINKED = ("createFile", "retrieveFile", "downloadFile", "createBatch", "retrieveBatch", "cancelBatch")

# /healthz takes no input, and its 503 (no worker polling) is the truth here.
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations() if isinstance(r, Ok) and r.ok().path != "/healthz"]
# Invalid input needs something to be invalid: a body or a typed query parameter (a path
# segment is any string).
NEGATABLE = [op for op in OPERATIONS if "requestBody" in op.definition.raw
             or any(p["in"] == "query" for p in op.definition.raw.get("parameters", ()))]
CASES = ([pytest.param(op.label, GenerationMode.POSITIVE, id=f"{op.label}-positive") for op in OPERATIONS]
         + [pytest.param(op.label, GenerationMode.NEGATIVE, id=f"{op.label}-negative") for op in NEGATABLE])

# About 40 s for this file on two cores, starting Temporal's dev server included.
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])


class _OnLoop(requests.adapters.BaseAdapter):
    """Sends what schemathesis prepared through the in-process app, on pytest's loop."""

    def __init__(self, client, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.client, self.loop = client, loop
        self.always_key = False

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        # The spec's bearer scheme makes schemathesis send keys of its own invention: the
        # client's real key goes instead, so that what is fuzzed is the input behind it. A
        # case without one (negative: auth left out) goes without, and must be refused;
        # unless `always_key` (the linked calls test links, not keys).
        headers = {k: v for k, v in request.headers.items() if k.lower() != "authorization"}
        built = self.client.build_request(request.method, request.url, headers=headers, content=request.body)
        if "authorization" not in request.headers and not self.always_key:
            del built.headers["authorization"]
        call = self.client.send(built)
        r = asyncio.run_coroutine_threadsafe(call, self.loop).result(timeout=60)
        raw = urllib3.HTTPResponse(io.BytesIO(r.content), headers=r.headers.multi_items(), status=r.status_code,
                                   reason=r.reason_phrase, preload_content=False, version=11)
        return requests.adapters.HTTPAdapter().build_response(request, raw)

    def close(self) -> None:
        pass


@pytest.fixture
async def wire(settings, db, temporal_client, default_key):
    async with build(settings.model_copy(update=dict(api_docs=True)), db, temporal_client, default_key) as client:
        assert (await client.get("/openapi.json")).json() == SPEC  # what is fuzzed is what is served
        session = requests.Session()
        session.mount(BASE, _OnLoop(client, asyncio.get_running_loop()))
        yield session


@pytest.fixture
def keyed_wire(wire):
    wire.get_adapter(BASE).always_key = True
    return wire


def _operation_id(case) -> str | None:
    return case.operation.definition.raw.get("operationId")


def _error_code(response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def no_server_error(ctx, response, case):
    """Not a 5xx, but for chat and completions without an engine: 503 engine_unavailable."""
    no_engine = (response.status_code, _error_code(response)) == (503, "engine_unavailable")
    if no_engine and _operation_id(case) in GENERATION:
        return None
    return not_a_server_error(ctx, response, case)


# What a body valid by the schema may still meet: the conditions the schema states in
# words (a context length, text Postgres cannot hold, min_tokens over max_tokens, a body
# over the deployment's size limit). Anything else means the documented
# schema and `protocol.requests.parse` disagree.
_VALID_BUT = {503: {"engine_unavailable"}, 413: {"request_too_large"},
              400: {"context_length_exceeded", "unsupported_character", rules.MIN_OVER_MAX, rules.TOOLS_CONFLICT}}


def schema_agrees_with_parse(ctx, response, case):
    if _operation_id(case) in GENERATION and case.meta.generation.mode == GenerationMode.POSITIVE:
        assert _error_code(response) in _VALID_BUT.get(response.status_code, ()), (
            f"a body valid by the schema got {response.status_code}: {response.text[:300]}")


DOCUMENTED = [status_code_conformance, content_type_conformance, response_schema_conformance]
CHECKS = [no_server_error, negative_data_rejection, schema_agrees_with_parse, *DOCUMENTED]
# On the multipart wire every part is bytes: a `file` "of the wrong type" (null, 3, {})
# arrives as the valid file `null`, `3`, `{}`. Only JSON bodies can be invalid by type.
MULTIPART_CHECKS = [c for c in CHECKS if c is not negative_data_rejection]


def _as_parse_reads_it(case):
    """A valid body names the served model: any other is a 404
    before the rest is judged in full."""
    if isinstance(case.body, dict):
        case.body = case.body | {"model": MODEL}
    return case


def test_the_documented_parameters_are_the_ones_parse_knows():
    assert set(documented.chat_request()["properties"]) == set(rules._CHAT)
    assert set(documented.completions_request()["properties"]) == set(rules._COMPLETIONS)


@pytest.mark.parametrize("label, mode", CASES)
async def test_no_input_is_a_server_error(wire, label, mode):
    operation = SCHEMA.find_operation_by_label(label)
    strategy = operation.as_strategy(generation_mode=mode)
    if operation.definition.raw.get("operationId") in GENERATION and mode == GenerationMode.POSITIVE:
        strategy = strategy.map(_as_parse_reads_it)
    checks = MULTIPART_CHECKS if operation.definition.raw.get("operationId") == "createFile" else CHECKS

    @FUZZ
    @given(case=strategy)
    def fuzz(case):
        case.call_and_validate(session=wire, checks=checks)

    await asyncio.to_thread(fuzz)


async def test_linked_calls_never_meet_a_server_error(keyed_wire):
    wire = keyed_wire
    seen: Counter[tuple[str | None, int]] = Counter()

    # Only the operations the links join: the others would dilute the scenarios.
    class Links(SCHEMA.include(operation_id=list(LINKED)).as_state_machine()):
        def get_call_kwargs(self, case):
            return {"session": wire}

        def after_call(self, response, case):
            super().after_call(response, case)
            seen[_operation_id(case), response.status_code] += 1

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            case.validate_response(response, checks=[no_server_error, *DOCUMENTED], transport_kwargs=kwargs)

    # The links must be followed, not just declared: batches made from uploads read and
    # cancelled. Most generated uploads are refused, so a short run may not get that far:
    # longer ones follow until it has (each is deterministic, the server's answers aside).
    steps = ("createFile", "createBatch", "retrieveBatch", "cancelBatch")
    for examples in (15, 40, 100):
        await asyncio.to_thread(Links.run, settings=settings(FUZZ, max_examples=examples, stateful_step_count=8))
        if all(seen[step, 200] for step in steps):
            break
    for step in steps:
        assert seen[step, 200], (step, dict(seen))
