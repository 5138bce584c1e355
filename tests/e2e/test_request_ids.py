"""One request id, everywhere: a chat sent with the client's x-request-id through the real
API and engine worker processes; the id comes back in the response (the official client's
own view), and is found in the API's access log line, the engine worker's log line and
the journal's record of the request."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from config.database import libpq_url

pytestmark = pytest.mark.e2e


def test_a_clients_request_id_is_found_everywhere(stack, db_url, tiny_model):
    mine = f"client-{uuid.uuid4().hex}"
    raw = stack.openai().chat.completions.with_raw_response.create(
        model=tiny_model.name, max_tokens=4, messages=[dict(role="user", content="hi")],
        extra_headers={"x-request-id": mine})
    chat = raw.parse()
    assert raw.headers["x-request-id"] == mine and chat._request_id == mine

    def found() -> dict[str, bool]:
        logs = {name: (stack.root / "logs" / f"{name}.log") for name in ("api", "engine-1")}
        seen = {name: mine in path.read_text(errors="replace") for name, path in logs.items()}
        with psycopg.connect(libpq_url(db_url)) as conn:
            row = conn.execute("SELECT record->>'http_request_id' FROM finished_requests WHERE request_id = %s",
                               (chat.id,)).fetchone()
        return dict(seen, journal=row is not None and row[0] == mine)

    deadline = time.monotonic() + 60
    while not all((where := found()).values()):
        assert time.monotonic() < deadline, where
        time.sleep(0.5)
