"""The API ↔ engine wire keeps its shape: each line is the JSON object it always was (an
API and an engine worker of different versions still read each other), and what an older
peer leaves out takes a default."""

import json

import pytest

from protocol import engine_wire as wire

LINES = [
    ('{"prompt_tokens": 12}', wire.Accepted(12)),
    ('{"text": "Hel", "tokens": 1}', wire.Delta("Hel", 1)),
    ('{"finish_reason": "stop", "completion_tokens": 17, "engine_ttft_ms": 4.5, "engine_ms": 80.0}',
     wire.Finished("stop", 17, 4.5, 80.0)),
    # What newer engines add where a request uses it.
    ('{"text": "a", "tokens": 1, "logprobs": [[["a", -0.5], ["b", -1.25]]]}',
     wire.Delta("a", 1, [[["a", -0.5], ["b", -1.25]]])),
    ('{"finish_reason": "stop", "completion_tokens": 2, "engine_ttft_ms": null, "engine_ms": null, '
     '"cached_tokens": 16}', wire.Finished("stop", 2, cached_tokens=16)),
    ('{"text": "<tool", "tokens": 2, "message": {}}', wire.Delta("<tool", 2, message={})),
    ('{"text": "}", "tokens": 1, "message": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}}',
     wire.Delta("}", 1, message={"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]})),
    ('{"finish_reason": "tool_calls", "completion_tokens": 9, "engine_ttft_ms": null, "engine_ms": null, '
     '"message": {"content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", '
     '"arguments": "{}"}}]}}',
     wire.Finished("tool_calls", 9, message={"content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})),
    # Several choices: each delta says which, and the end how each ended.
    ('{"text": "b", "tokens": 1, "choice": 2}', wire.Delta("b", 1, choice=2)),
    ('{"finish_reason": "stop", "completion_tokens": 5, "engine_ttft_ms": null, "engine_ms": null, '
     '"choices": [{"finish_reason": "stop", "completion_tokens": 2, "message": null}, '
     '{"finish_reason": "length", "completion_tokens": 3, "message": null}]}',
     wire.Finished("stop", 5, choices=[wire.Ending("stop", 2), wire.Ending("length", 3)])),
    ('{"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": "x"}, "status": 400}',
     wire.Failed({"message": "no", "type": "invalid_request_error", "param": None, "code": "x"}, 400)),
]


@pytest.mark.parametrize("raw, line", LINES)
def test_each_line_is_the_json_it_always_was(raw, line):
    assert wire.decode(raw) == line
    assert json.loads(wire.encode(line)) == json.loads(raw)
    assert wire.encode(line).endswith(b"\n") and wire.encode(line).count(b"\n") == 1


def test_what_an_older_engine_leaves_out_takes_its_default():
    assert wire.decode('{"finish_reason": "length", "completion_tokens": 3}') == wire.Finished("length", 3)
    assert wire.decode('{"text": "a"}') == wire.Delta("a", 0)
    assert wire.decode('{"error": {"message": "m"}}').status == 500


@pytest.mark.parametrize("raw", ['{"what": 1}', "[1, 2]", "not json"])
def test_anything_else_is_refused(raw):
    with pytest.raises(ValueError):
        wire.decode(raw)


def test_a_job_from_an_older_api_gets_the_defaults():
    old = dict(request_id="r", endpoint="/v1/chat/completions", body={"model": "m"}, priority="1")
    job = wire.EngineJob.from_json(old)
    assert (job.priority, job.tenant, job.tier, job.weight, job.api) == (1, "", None, 1.0, "")
    assert wire.EngineJob.from_json(job.to_json()) == job


def test_stats_keep_what_they_do_not_name_and_default_the_rest():
    raw = {"interactive": 3, "region": "eu", "something_new": [1]}
    s = wire.EngineStats.from_json(raw)
    assert (s.interactive, s.region, s.max_seqs, s.interactive_by) == (3, "eu", 1, None)
    assert s.extra == {"something_new": [1]}
    assert wire.EngineStats.from_json(s.to_json()) == s and s.to_json()["something_new"] == [1]
