"""Embeddings requests as OpenAI's API states them, and the response's two encodings as
OpenAI's own client decodes them."""

from __future__ import annotations

import base64
import struct

import pytest

from protocol.embeddings import MAX_INPUTS, EmbeddingRequest, check_lengths, encoded, parse, response, wrong_task
from protocol.errors import ProtocolError
from protocol.requests import CHAT, EMBEDDINGS, RequestLimits

LIMITS = RequestLimits("emb", 512, others=("chat-model",))


@pytest.mark.parametrize("given, inputs", [
    ("one text", ("one text",)),
    (["a", "b"], ("a", "b")),
    ([5, 17, 9], ((5, 17, 9),)),
    ([5.0, 17], ((5, 17),)),  # JSON Schema's integers
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_the_four_forms_of_input(given, inputs):
    got = parse(dict(model="emb", input=given), LIMITS)
    assert isinstance(got, EmbeddingRequest) and got.inputs == inputs and got.n == len(inputs)
    assert (got.base64, got.dimensions, got.add_special_tokens, got.endpoint) == (False, None, True, EMBEDDINGS)


def test_options_and_nulls():
    got = parse(dict(model="emb", input="x", encoding_format="base64", dimensions=64.0, user="u",
                     add_special_tokens=False), LIMITS)
    assert isinstance(got, EmbeddingRequest) and got.base64 and got.dimensions == 64 and not got.add_special_tokens
    nulls = parse(dict(model="emb", input="x", encoding_format=None, dimensions=None, user=None,
                       add_special_tokens=None), LIMITS)
    assert nulls == parse(dict(model="emb", input="x"), LIMITS)


@pytest.mark.parametrize("body, status, param", [
    (dict(input="x"), 400, "model"),
    (dict(model="other", input="x"), 404, "model"),
    (dict(model="emb"), 400, "input"),
    (dict(model="emb", input=""), 400, "input"),
    (dict(model="emb", input=[]), 400, "input"),
    (dict(model="emb", input=["a", ""]), 400, "input"),
    (dict(model="emb", input=["a", [1]]), 400, "input"),
    (dict(model="emb", input=[1, -2]), 400, "input"),
    (dict(model="emb", input=[True, 2]), 400, "input"),
    (dict(model="emb", input=["x"] * (MAX_INPUTS + 1)), 400, "input"),
    (dict(model="emb", input="x", encoding_format="int8"), 400, "encoding_format"),
    (dict(model="emb", input="x", dimensions=0), 400, "dimensions"),
    (dict(model="emb", input="x", dimensions=True), 400, "dimensions"),
    (dict(model="emb", input="x", add_special_tokens="yes"), 400, "add_special_tokens"),
    (dict(model="emb", input="x", truncate_prompt_tokens=3), 400, "truncate_prompt_tokens"),
    (dict(model="emb", input="a\x00b"), 400, "input"),
])
def test_refusals_name_their_parameter(body, status, param):
    got = parse(body, LIMITS)
    assert isinstance(got, ProtocolError) and (got.status_code, got.param) == (status, param), got


def test_the_404_names_every_model():
    got = parse(dict(model="nope", input="x"), LIMITS)
    assert isinstance(got, ProtocolError) and "'chat-model', 'emb'" in got.message


def test_a_model_serves_its_task_alone():
    assert wrong_task("emb", True, EMBEDDINGS) is None and wrong_task("gen", False, CHAT) is None
    assert "embedding model" in wrong_task("emb", True, CHAT).message
    assert "no embeddings" in wrong_task("gen", False, EMBEDDINGS).message


def test_inputs_must_fit_the_context():
    assert check_lengths([512, 3], 512) is None
    too = check_lengths([3, 513], 512)
    assert too is not None and too.code == "context_length_exceeded" and "input 1" in too.message


def test_base64_is_little_endian_float32_as_openais_client_decodes_it():
    vector = [0.5, -1.25, 3.0e-8, 1.0]
    raw = base64.b64decode(encoded(vector, True))
    assert struct.unpack("<4f", raw) == pytest.approx(tuple(vector), rel=1e-7)
    # openai-python's own decoder (numpy's frombuffer of float32), where numpy is installed
    np = pytest.importorskip("numpy")
    assert np.frombuffer(raw, dtype="float32").tolist() == pytest.approx(vector, rel=1e-7)
    assert encoded(vector, False) is vector


def test_the_response_is_openais_shape():
    body = response("emb", [[1.0, 0.0], [0.0, 1.0]], 7, False)
    assert body == dict(object="list", model="emb", usage=dict(prompt_tokens=7, total_tokens=7), data=[
        dict(object="embedding", index=0, embedding=[1.0, 0.0]),
        dict(object="embedding", index=1, embedding=[0.0, 1.0])])
