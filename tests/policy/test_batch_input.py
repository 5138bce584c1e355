"""Reading batch input files: which problems fail the file, which fail one request."""

import json

from activities.batch_input import Limits, check_request, parse

LIMITS = Limits("/v1/chat/completions", "ballast-tiny", 1024, max_lines=5)


def line(custom_id="a", url="/v1/chat/completions", **body) -> bytes:
    b = dict(model="ballast-tiny", messages=[{"role": "user", "content": "hi"}])
    b.update(body)
    return json.dumps(dict(custom_id=custom_id, method="POST", url=url, body=b)).encode()


def test_a_clean_file_parses_in_order_skipping_blank_lines():
    items, errors = parse([line("a"), b"\n", line("b", max_tokens=4)], LIMITS)
    assert errors == []
    assert [(i.idx, i.line, i.custom_id) for i in items] == [(0, 1, "a"), (1, 3, "b")]


def test_file_level_errors_name_their_lines():
    raw = [line("a"), b"{oops", line("a"), line("c", url="/v1/embeddings"), b"[1]", line(""), b'{"custom_id":"z","method":"GET"}']
    _, errors = parse(raw, LIMITS)
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_endpoint"),
        (5, "invalid_json_line"), (6, "missing_required_parameter"), (7, "invalid_method"),
    ]
    assert "line 1" in errors[1].message  # the duplicate points at the first one


def test_empty_and_oversize_files():
    assert [e.code for e in parse([b"", b"  \n"], LIMITS)[1]] == ["empty_file"]
    _, errors = parse([line(str(i)) for i in range(7)], LIMITS)
    assert [(e.line, e.code) for e in errors] == [(6, "too_many_requests")]


def test_request_level_errors_stay_with_their_request():
    items, errors = parse([line("a", max_tokens=5000), line("b", model="gpt-9"), line("c", messages=[])], LIMITS)
    assert errors == []
    codes = [(i.error.status_code, i.error.code, i.error.param) for i in items]
    assert codes == [(400, "context_length_exceeded", "max_tokens"), (400, "model_not_found", "model"),
                     (400, "invalid_value", "messages")]
    assert items[0].error.message.startswith("Line 1:")


def test_check_request_on_completions():
    lim = Limits("/v1/completions", "ballast-tiny", 1024)
    ok = dict(model="ballast-tiny", prompt="hello", max_tokens=3)
    assert check_request("/v1/completions", ok, lim) is None
    assert check_request("/v1/completions", dict(ok, prompt=[1, 2, 3]), lim) is None
    assert check_request("/v1/completions", dict(ok, prompt=None), lim).param == "prompt"
    assert check_request("/v1/completions", dict(ok, max_tokens=0), lim).param == "max_tokens"
    assert check_request("/v1/completions", dict(ok, temperature=3), lim).param == "temperature"
    assert check_request("/v1/completions", dict(ok, n=2), lim).param == "n"
