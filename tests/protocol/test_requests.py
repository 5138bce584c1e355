"""The request checks: OpenAI's parameters, each supported or refused by name; any JSON
in any field gives a 400 or a valid request, never an exception."""

import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.admission import estimate
from protocol.errors import ProtocolError
from protocol.requests import CHAT, COMPLETIONS, TOOLS_CONFLICT, GenerationRequest, RequestLimits, fit_context, parse

LIMITS = RequestLimits("ballast-tiny", 1024)
CHAT_OK = dict(model="ballast-tiny", messages=[{"role": "user", "content": "hi"}])
COMPLETION_OK = dict(model="ballast-tiny", prompt="hello")


def _openai_params(module) -> list[str]:
    return sorted(typing.get_type_hints(module.CompletionCreateParamsBase))


def test_a_plain_request_gets_openai_defaults():
    r = parse(CHAT, CHAT_OK, LIMITS)
    assert r == GenerationRequest(CHAT, "ballast-tiny", messages=r.messages, max_tokens=None)
    assert (r.temperature, r.top_p, r.service_tier, r.stream) == (1.0, 1.0, "default", False)
    c = parse(COMPLETIONS, COMPLETION_OK, LIMITS)
    assert c.max_tokens == 16  # the completions default, as OpenAI's and vLLM's


@pytest.mark.parametrize("endpoint,base", [(CHAT, CHAT_OK), (COMPLETIONS, COMPLETION_OK)])
def test_every_parameter_of_the_official_client_is_known(endpoint, base):
    # The oracle is the official client's own list of parameters: none may be "unrecognized".
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    names = _openai_params(chat_params if endpoint == CHAT else completion_create_params)
    assert len(names) > 10
    for name in names:
        for value in ("junk-value", 12345, [1], {"x": 1}):
            got = parse(endpoint, dict(base, **{name: value}), LIMITS)
            if isinstance(got, ProtocolError):
                assert not (got.code == "unknown_parameter" and got.param == name), name
                assert got.param is not None and got.param.split(".")[0].split("[")[0] == name, (name, got)
                assert 400 <= got.status_code < 500


@pytest.mark.parametrize("field,value,param", [
    ("temperature", 2.5, "temperature"), ("temperature", "0.5", "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("top_p", -0.1, "top_p"), ("top_p", 1.5, "top_p"), ("n", 129, "n"), ("n", True, "n"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", True, "max_tokens"), ("max_tokens", 5000, "max_tokens"), ("seed", 2**63, "seed"),
    ("stop", 7, "stop"), ("stop", ["a"] * 5, "stop"), ("stop", [1], "stop"), ("stop", ["x" * 257], "stop"),
    ("stop", "x" * 257, "stop"), ("stream", "yes", "stream"),
    ("stream_options", "yes", "stream_options"), ("stream_options", {"include_usage": True}, "stream_options"),
    ("messages", "hi", "messages"), ("messages", [], "messages"),
    ("messages", [{"role": "bot", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": None}], "messages[0].content"),
    ("messages", [{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ("tools", [{"type": "function"}], "tools[0]"),
    ("tools", [{"type": "custom", "custom": {"name": "x"}}], "tools[0].type"),
    ("tools", [{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ("tool_choice", "required", "tool_choice"), ("tool_choice", {"type": "allowed_tools"}, "tool_choice"),
    ("messages", [{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ("messages", [{"role": "function", "name": "f", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0]"),
    ("logprobs", 1, "logprobs"),
    ("top_logprobs", 21, "top_logprobs"), ("top_logprobs", 2, "top_logprobs"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("logit_bias", {"x": 1}, "logit_bias"), ("logit_bias", {"5": "a"}, "logit_bias"),
    ("logit_bias", {"¹": 0}, "logit_bias"), ("logit_bias", {"١": 0}, "logit_bias"),
    ("repetition_penalty", 0, "repetition_penalty"), ("top_k", -2, "top_k"), ("min_p", 1.5, "min_p"),
    ("min_tokens", -1, "min_tokens"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("chat_template_kwargs", [], "chat_template_kwargs"),
    ("service_tier", "scale", "service_tier"), ("model", None, "model"), ("model", 3, "model"), ("bogus", 1, "bogus"),
    ("response_format", {"type": "structural_tag"}, "response_format"),
    ("response_format", {"type": "json_schema"}, "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ("structured_outputs", {"choice": []}, "structured_outputs.choice"),
])
def test_refusals_name_their_parameter(field, value, param):
    got = parse(CHAT, dict(CHAT_OK, **{field: value}), LIMITS)
    assert isinstance(got, ProtocolError), got
    assert (got.status_code, got.param) == (400, param), got
    assert got.message and got.code


def test_unknown_model_is_404_and_nulls_mean_defaults():
    assert parse(CHAT, dict(CHAT_OK, model="gpt-9"), LIMITS).status_code == 404
    nulls = dict(CHAT_OK, temperature=None, top_p=None, max_tokens=None, stop=None, seed=None, n=None, stream=None,
                 stream_options=None, service_tier=None, tools=None, logprobs=None)
    assert isinstance(parse(CHAT, nulls, LIMITS), GenerationRequest)


def test_what_openai_accepts_and_vllm_would_not_is_served_as_meant():
    greedy = parse(CHAT, dict(CHAT_OK, top_p=0, temperature=0.7), LIMITS)
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)  # only the likeliest token
    assert parse(CHAT, dict(CHAT_OK, stop=["", "x"]), LIMITS).stop == ("x",)  # "" stops nothing
    assert parse(CHAT, dict(CHAT_OK, stop=""), LIMITS).stop == ()
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=None), LIMITS).prompt == "<|endoftext|>"
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=["one"]), LIMITS).prompt == "one"
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=[[1, 2]]), LIMITS).prompt == (1, 2)
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=["a", "b"]), LIMITS).code == "unsupported_value"
    said = [dict(role="assistant", content=None, refusal="I can't."), dict(role="user", content=[
        dict(type="text", text="go", prompt_cache_breakpoint={"mode": "explicit"})], name=None, audio=None)]
    assert [m.content for m in parse(CHAT, dict(CHAT_OK, messages=said), LIMITS).messages] == ["I can't.", "go"]
    image = [dict(role="user", content=[dict(type="image_url", image_url=dict(url="https://x/y.png"))])]
    got = parse(CHAT, dict(CHAT_OK, messages=image), LIMITS)
    assert (got.code, got.param) == ("unsupported_value", "messages[0].content[0].image_url")
    assert parse(CHAT, dict(CHAT_OK, reasoning_effort="medium", verbosity="medium",
                            stream=True, stream_options=dict(include_obfuscation=False)), LIMITS).stream
    assert parse(CHAT, dict(CHAT_OK, service_tier="scale"), LIMITS).code == "unsupported_value"


def test_structured_outputs_as_vllm_takes_them():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_schema = dict(type="json_schema", json_schema=dict(name="x", schema=schema, strict=True))
    assert parse(CHAT, dict(CHAT_OK, response_format=as_schema), LIMITS).grammar == {"json": schema}
    assert parse(CHAT, dict(CHAT_OK, response_format={"type": "json_object"}), LIMITS).grammar == {"json_object": True}
    assert parse(CHAT, dict(CHAT_OK, response_format={"type": "text"}), LIMITS).grammar is None
    assert parse(COMPLETIONS, dict(COMPLETION_OK, structured_outputs={"choice": ["yes", "no"], "regex": None}),
                 LIMITS).grammar == {"choice": ["yes", "no"]}
    both = parse(CHAT, dict(CHAT_OK, response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}),
                 LIMITS)
    assert both.param == "structured_outputs"
    assert parse(CHAT, dict(CHAT_OK, response_format={"type": "json_object"}, min_tokens=2), LIMITS).param == \
        "min_tokens"


def test_vllm_extras_and_logprobs():
    r = parse(CHAT, dict(CHAT_OK, logprobs=True, top_logprobs=3, logit_bias={"7": 150, "3": -1.5}, top_k=5,
                         presence_penalty=0.5, stop_token_ids=[4, 9], min_tokens=2, max_tokens=8), LIMITS)
    assert (r.logprobs, r.logit_bias, r.top_k, r.presence_penalty, r.stop_token_ids, r.min_tokens) == (
        3, ((3, -1.5), (7, 100.0)), 5, 0.5, (4, 9), 2)
    assert parse(CHAT, dict(CHAT_OK, logprobs=True), LIMITS).logprobs == 0  # the sampled token's only
    assert parse(CHAT, dict(CHAT_OK, logprobs=False, top_logprobs=0), LIMITS).logprobs is None
    assert parse(COMPLETIONS, dict(COMPLETION_OK, logprobs=0), LIMITS).logprobs == 0
    assert parse(CHAT, dict(CHAT_OK, min_tokens=9, max_tokens=8), LIMITS).param == "min_tokens"


def test_streaming_options_and_tiers():
    r = parse(CHAT, dict(CHAT_OK, stream=True, stream_options={"include_usage": True}, service_tier="auto"), LIMITS)
    assert (r.stream, r.include_usage, r.service_tier) == (True, True, "default")
    assert parse(CHAT, dict(CHAT_OK, stream=True), LIMITS, batch=True).param == "stream"


def test_text_that_cannot_be_stored_or_encoded_is_refused_where_it_is():
    got = parse(CHAT, dict(CHAT_OK, messages=[{"role": "user", "content": "a\ud800"}]), LIMITS)
    assert (got.code, got.param) == ("unsupported_character", "messages[0].content")
    got = parse(COMPLETIONS, dict(COMPLETION_OK, user="x\x00"), LIMITS)
    assert (got.code, got.param) == ("unsupported_character", "user")


def test_prompts_of_token_ids_and_the_context():
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=[1, 2, 3]), LIMITS).prompt == (1, 2, 3)
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=[-1]), LIMITS).param == "prompt"
    assert parse(COMPLETIONS, dict(COMPLETION_OK, prompt=["a", "b"]), LIMITS).code == "unsupported_value"
    r = parse(CHAT, dict(CHAT_OK, max_tokens=100), LIMITS)
    assert fit_context(r, 950, 1024).code == "context_length_exceeded"
    assert fit_context(r, 10, 1024) == 100
    assert fit_context(parse(CHAT, CHAT_OK, LIMITS), 1000, 1024) == 24  # no max_tokens: the rest of the context


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(sorted(set(_openai_params(__import__("openai.types.chat.completion_create_params",
                                                                 fromlist=["x"]))) | {"stream", "ignore_eos", "junk"}))


@settings(max_examples=400, deadline=None)
@given(endpoint=st.sampled_from([CHAT, COMPLETIONS]), overrides=st.dictionaries(fields, json_values, max_size=4),
       whole=st.one_of(st.none(), json_values))
def test_any_json_gives_a_4xx_or_a_valid_request(endpoint, overrides, whole):
    base = CHAT_OK if endpoint == CHAT else COMPLETION_OK
    body = dict(base, **overrides) if whole is None else whole
    got = parse(endpoint, body, LIMITS)
    if isinstance(got, ProtocolError):
        assert 400 <= got.status_code < 500 and got.message
        json.dumps(got.body())  # serialisable, as it goes on the wire
    else:
        assert isinstance(got, GenerationRequest)
        assert got.max_tokens is None or 1 <= got.max_tokens <= LIMITS.max_model_len
        assert 0 <= got.temperature <= 2 and 0 < got.top_p <= 1


def test_whole_floats_are_integers_as_in_json_schema_and_vllm():
    r = parse(COMPLETIONS, dict(COMPLETION_OK, prompt=[1.0, 2], max_tokens=16.0, seed=3.0), LIMITS)
    assert (r.prompt, r.max_tokens, r.seed) == ((1, 2), 16, 3)
    assert parse(COMPLETIONS, dict(COMPLETION_OK, max_tokens=16.5), LIMITS).param == "max_tokens"


def test_echo_and_the_prompt_alone():
    comp = dict(model="ballast-tiny", prompt="hi")
    assert parse(COMPLETIONS, dict(comp, echo=True, logprobs=1), LIMITS).echo
    alone = parse(COMPLETIONS, dict(comp, echo=True, max_tokens=0), LIMITS)
    assert not isinstance(alone, ProtocolError) and alone.max_tokens == 0
    for endpoint, body in ((COMPLETIONS, dict(comp, max_tokens=0)), (CHAT, dict(CHAT_OK, max_completion_tokens=0))):
        got = parse(endpoint, body, LIMITS)
        assert isinstance(got, ProtocolError) and got.code == "unsupported_value" and got.param in (
            "max_tokens", "max_completion_tokens"), got


def test_tools_as_vllm_renders_them():
    weather = {"type": "function",
               "function": {"name": "get_weather", "strict": False, "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = parse(CHAT, dict(CHAT_OK, tools=[weather], messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        LIMITS)
    assert not isinstance(req, ProtocolError), req
    assert req.tool_choice == "auto" and req.parallel_tool_calls  # OpenAI's defaults where tools are given
    messages, tools = req.chat_inputs()
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": None,
                                                       "parameters": {"type": "object"}}}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, as vLLM passes it
    assert messages[2] == {"role": "tool", "content": "a\nb", "tool_call_id": "c1"}
    assert parse(CHAT, dict(CHAT_OK, tools=[]), LIMITS).tool_choice is None
    named = dict(CHAT_OK, tools=[weather], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert parse(CHAT, named, LIMITS).code == TOOLS_CONFLICT
    forced = dict(CHAT_OK, tools=[weather], tool_choice="required", response_format={"type": "json_object"})
    assert parse(CHAT, forced, LIMITS).code == TOOLS_CONFLICT


def test_n_asks_for_that_many_choices_and_reserves_each_ones_output():
    got = parse(CHAT, dict(CHAT_OK, n=3, max_tokens=10, temperature=0.5), LIMITS)
    assert isinstance(got, GenerationRequest) and got.n == 3
    assert estimate(got, 1024)[1] == 30  # three choices of up to 10 tokens each
    assert parse(CHAT, dict(CHAT_OK, n=None), LIMITS).n == 1
    assert isinstance(parse(CHAT, dict(CHAT_OK, n=0), LIMITS), ProtocolError)
    for greedy in (dict(temperature=0), dict(top_p=0)):  # one text n times: refused, as vLLM refuses it
        refused = parse(CHAT, dict(CHAT_OK, n=2, **greedy), LIMITS)
        assert isinstance(refused, ProtocolError) and (refused.param, refused.code) == ("n", "unsupported_value")
