"""Reading batch input files: which problems fail the file, which fail one request."""

import json

from protocol.batch import FileLimits, Item, LineError, file_errors, scan
from protocol.requests import RequestLimits

LIMITS = FileLimits("/v1/chat/completions", RequestLimits("ballast-tiny", 1024), max_lines=5)


def line(custom_id="a", url="/v1/chat/completions", **body) -> bytes:
    b = dict(model="ballast-tiny", messages=[{"role": "user", "content": "hi"}])
    b.update(body)
    return json.dumps(dict(custom_id=custom_id, method="POST", url=url, body=b)).encode()


def parse(lines, limits=FileLimits("/v1/chat/completions", RequestLimits("ballast-tiny", 1024), max_lines=50)):
    got = list(scan(lines, limits))
    return [g for g in got if isinstance(g, Item)], [g for g in got if isinstance(g, LineError)]


def test_a_clean_file_parses_in_order_skipping_blank_lines():
    items, errors = parse([line("a"), b"\n", line("b", max_tokens=4)])
    assert errors == []
    assert [(i.idx, i.line, i.custom_id, i.error) for i in items] == [(0, 1, "a", None), (1, 3, "b", None)]


def test_file_level_errors_name_their_lines():
    raw = [line("a"), b"{oops", line("a"), line("c", url="/v1/embeddings"), b"[1]", line(""),
           b'{"custom_id":"z","method":"GET"}', b'{"custom_id": "\\u0000x", "method": "POST"}',
           b'{"custom_id": "\\ud800", "method": "POST"}']
    errors = file_errors(raw, FileLimits("/v1/chat/completions", LIMITS.request, max_lines=50))
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_endpoint"),
        (5, "invalid_json_line"), (6, "missing_required_parameter"), (7, "invalid_method"),
        (8, "unsupported_character"), (9, "unsupported_character"),
    ]
    assert "line 1" in errors[1].message  # the duplicate points at the first one
    # Every message can be stored as JSONB: no NUL, no lone surrogate echoed back.
    for e in errors:
        json.dumps(e.as_openai()).encode("utf-8")
        assert "\x00" not in e.message


def test_empty_and_oversize_files():
    assert [e.code for e in parse([b"", b"  \n"])[1]] == ["empty_file"]
    _, errors = parse([line(str(i)) for i in range(7)], LIMITS)
    assert [(e.line, e.code) for e in errors] == [(6, "too_many_requests")]


def test_request_level_errors_stay_with_their_request():
    items, errors = parse([line("a", max_tokens=5000), line("b", model="gpt-9"), line("c", messages=[]),
                           line("d", temperature=None), line("e", top_p=-1), line("f", stop=7)])
    assert errors == []
    codes = [(i.error.status_code, i.error.code, i.error.param) if i.error else None for i in items]
    assert codes == [(400, "context_length_exceeded", "max_tokens"), (404, "model_not_found", "model"),
                     (400, "invalid_type", "messages"), None,  # null means the default, as in OpenAI's API
                     (400, "invalid_value", "top_p"), (400, "invalid_type", "stop")]
    assert items[0].error.message.startswith("Line 1:")


def test_text_postgres_cannot_store_fails_its_line_not_the_file():
    raw = [line("a"), b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", '
                      b'"body": {"model": "ballast-tiny", "messages": [{"role": "user", "content": "x\\ud800"}]}}',
           line("c", messages=[{"role": "user", "content": "nul\u0000"}])]
    items, errors = parse(raw)
    assert errors == []
    bad = {i.custom_id: i for i in items if i.error}
    assert set(bad) == {"b", "c"}
    assert bad["b"].error.param == "messages[0].content" and bad["b"].error.message.startswith("Line 2:")
    assert bad["b"].body == {}  # what cannot be stored is not kept; the error says where it was


def test_streaming_is_refused_inside_a_batch():
    items, _ = parse([line("a", stream=True), line("b", stream=False)])
    assert [i.error and i.error.param for i in items] == ["stream", None]
