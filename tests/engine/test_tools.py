"""Tool calls as the engine reads them: vLLM's hermes parser over the tiny model's tokenizer,
no engine running. Whether the answers equal vLLM's own server's is tests/e2e/test_oracle.py's
question; here, what the wiring around the parser decides."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine import sampling, tools
from protocol.errors import ProtocolError
from protocol.requests import CHAT, RequestLimits, parse

WEATHER = dict(type="function", function=dict(name="get_weather", strict=True, parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
CLOCK = dict(type="function", function=dict(name="get_time", parameters={"type": "object"}))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def request(**extra):
    body = dict(model="m", messages=[dict(role="user", content="hi")], tools=[WEATHER, CLOCK]) | extra
    got = parse(CHAT, body, RequestLimits("m", 1024))
    assert not isinstance(got, ProtocolError), got
    return got


@pytest.fixture(scope="module")
def engine(tiny_model):
    from transformers import AutoTokenizer
    from vllm.parser import ParserManager

    return SimpleNamespace(spec=tiny_model, tokenizer=AutoTokenizer.from_pretrained(tiny_model.path), model_config=None,
                           tool_parser=ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True))


def test_a_model_without_a_parser_takes_tools_only_to_ignore_them():
    bare = SimpleNamespace(spec=SimpleNamespace(name="m"), tool_parser=None)
    no = tools.refusal(bare, request())
    assert isinstance(no, ProtocolError) and no.param == "tool_choice" and "BALLAST_TOOL_CALL_PARSER" in no.message
    assert tools.refusal(bare, request(tool_choice="none")) is None
    assert tools.refusal(bare, parse(CHAT, dict(model="m", messages=[dict(role="user", content="hi")]),
                                     RequestLimits("m", 1024))) is None


def test_auto_reads_calls_from_free_text(engine):
    lax = tools.Calls(engine, request(tools=[CLOCK]))
    assert lax.constrain(sampling.Sampling(8)).grammar is None  # auto: the model is free...
    calls = tools.Calls(engine, request())
    # ...but a strict tool's arguments follow its schema once the model opens a call.
    assert "triggered_tags" in (calls.constrain(sampling.Sampling(8)).grammar or {})["structural_tag"]
    m = calls.whole("Sure. " + CALL, "stop")
    assert m.content == "Sure. " and m.finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert m.tool_calls[0]["id"] and m.tool_calls[0]["type"] == "function"
    plain = tools.Calls(engine, request()).whole("no call here", "length")
    assert (plain.content, plain.tool_calls, plain.finish_reason) == ("no call here", [], "length")


def test_forced_calls_are_constrained_and_finish_as_openai_says(engine):
    named = tools.Calls(engine, request(tool_choice=dict(type="function", function=dict(name="get_weather"))))
    s = named.constrain(sampling.Sampling(8))
    assert set(s.grammar or {}) <= set(tools.CONSTRAINTS) and s.grammar
    m = named.whole(CALL, "stop")
    assert (m.content, m.finish_reason, len(m.tool_calls)) == ("", "stop", 1)  # a named function: "stop"
    both = tools.Calls(engine, request(tool_choice="required"))
    assert both.whole(CALL + TIME, "stop").finish_reason == "tool_calls"
    assert len(both.whole(CALL + TIME, "stop").tool_calls) == 2
    one = tools.Calls(engine, request(tool_choice="required", parallel_tool_calls=False))
    assert [c["function"]["name"] for c in one.whole(CALL + TIME, "stop").tool_calls] == ["get_weather"]


def test_a_stream_holds_back_a_half_written_call(engine):
    calls = tools.Calls(engine, request())
    shown = [calls.delta(piece, [0], [1, 2], i == 2) for i, piece in enumerate(["Hi ", CALL[:14], CALL[14:]])]
    assert shown[0] == {"content": "Hi "}
    pieces = [c for d in shown[1:] if d for c in d.get("tool_calls", [])]
    assert pieces and pieces[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"].get("arguments") or "" for p in pieces)) == {"city": "Oslo"}
    assert calls.stream_reason("stop") == "tool_calls"
