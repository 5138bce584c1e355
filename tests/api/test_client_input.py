"""No client input reaches the generic 500: what Postgres cannot hold (NUL, lone
surrogates) or cannot be an id is refused at the edge, in OpenAI's error shape."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import assert_openai_error

# Ids that cannot exist: NUL, a lone surrogate's UTF-8, a slash-free path with spaces,
# non-ASCII, and one far too long.
IMPOSSIBLE = ["%00", "file-%00", "%ED%A0%80", "a%20b", "caf%C3%A9", "x" * 129]


@pytest.mark.parametrize("bad", IMPOSSIBLE)
async def test_ids_that_cannot_exist_are_404_without_touching_postgres(bare_api, bad):
    assert_openai_error(await bare_api.get(f"/v1/files/{bad}"), 404, "file_id", "not_found")
    assert_openai_error(await bare_api.get(f"/v1/files/{bad}/content"), 404, "file_id", "not_found")
    assert_openai_error(await bare_api.get(f"/v1/batches/{bad}"), 404, "batch_id", "not_found")
    assert_openai_error(await bare_api.post(f"/v1/batches/{bad}/cancel"), 404, "batch_id", "not_found")


async def test_ids_that_could_exist_but_do_not_are_404(api):
    assert_openai_error(await api.get("/v1/files/file-nope"), 404, "file_id")
    assert_openai_error(await api.get("/v1/files/file-nope/content"), 404, "file_id")
    assert_openai_error(await api.get("/v1/batches/batch_nope"), 404, "batch_id")
    assert_openai_error(await api.post("/v1/batches/batch_nope/cancel"), 404, "batch_id")


@pytest.fixture
async def file_id(api):
    r = await api.post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _raw(body: str):
    """JSON text as sent, so escapes like \\u0000 and \\ud800 reach the server unchanged."""
    return dict(content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("metadata, param", [
    ('{"k": "a\\u0000b"}', "metadata"),
    ('{"a\\u0000b": "v"}', "metadata"),
    ('{"k": "\\ud800"}', "metadata"),
    ('{"\\udfff": "v"}', "metadata"),
    ('["k", "v"]', "metadata"),
    ('{"k": 1}', "metadata.k"),
    ('{"k": {"nested": "v"}}', "metadata.k"),
    ('"text"', "metadata"),
])
async def test_metadata_postgres_cannot_hold_is_400_naming_it(api, file_id, metadata, param):
    body = (f'{{"input_file_id": "{file_id}", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
            f'"metadata": {metadata}}}')
    assert_openai_error(await api.post("/v1/batches", **_raw(body)), 400, param)


@pytest.mark.parametrize("input_file_id", ["file-\\u0000", "\\ud800", "file-\\udc00x", "x" * 300])
async def test_an_input_file_id_that_cannot_exist_is_404(api, input_file_id):
    body = f'{{"input_file_id": "{input_file_id}", "endpoint": "/v1/chat/completions", "completion_window": "24h"}}'
    assert_openai_error(await api.post("/v1/batches", **_raw(body)), 404, "input_file_id", "not_found")


@pytest.mark.parametrize("change, param", [
    (dict(completion_window="1h"), "completion_window"),
    (dict(completion_window=24), "completion_window"),
    (dict(endpoint=3), "endpoint"),
    (dict(endpoint="/v1/responses"), "endpoint"),
    (dict(input_file_id=["file-x"]), "input_file_id"),
    (dict(input_file_id=None), "input_file_id"),
    (dict(metadata={str(i): "v" for i in range(17)}), "metadata"),
    (dict(metadata={"k" * 65: "v"}), "metadata"),
])
async def test_wrong_values_and_types_in_a_batch_are_400(api, file_id, change, param):
    body = dict(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h") | change
    assert_openai_error(await api.post("/v1/batches", json=body), 400, param)


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'"x"', b"\xff\xfe", b"null"])
async def test_a_batch_body_that_is_not_an_object_is_400(api, content):
    r = await api.post("/v1/batches", content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("params, param", [
    ({"limit": "abc"}, "limit"),
    ({"limit": "0"}, "limit"),
    ({"limit": "101"}, "limit"),
    ({"limit": "1e3"}, "limit"),
])
async def test_junk_list_parameters_are_400(api, params, param):
    assert_openai_error(await api.get("/v1/batches", params=params), 400, param)


@pytest.mark.parametrize("after", ["%00", "batch_%ED%A0%80", "x" * 500])
async def test_an_after_cursor_that_cannot_exist_pages_like_an_unknown_one(api, after):
    r = await api.get(f"/v1/batches?after={after}")
    assert r.status_code == 200, r.text
    assert r.json() == (await api.get("/v1/batches", params={"after": "batch_unknown"})).json()


async def test_uploads_missing_a_part_or_with_another_purpose_are_400(api):
    one = {"file": ("a.jsonl", b"{}\n")}
    assert_openai_error(await api.post("/v1/files", data={"purpose": "batch"}), 400, "file")
    assert_openai_error(await api.post("/v1/files", files=one), 400, "purpose")
    assert_openai_error(await api.post("/v1/files", files=one, data={"purpose": "assistants"}), 400, "purpose")
    assert_openai_error(await api.post("/v1/files", files=one, data={"purpose": "batch\x00"}), 400, "purpose")
    empty = {"file": ("a.jsonl", b"")}
    assert_openai_error(await api.post("/v1/files", files=empty, data={"purpose": "batch"}), 400, "file")
    assert_openai_error(await api.post("/v1/files", json={"purpose": "batch"}), 400)
    assert_openai_error(await api.post("/v1/files", content=b"--nope\r\n", headers={
        "content-type": "multipart/form-data; boundary=XX"}), 400)


@pytest.mark.parametrize("filename", [b"a\x00b.jsonl", b"caf\xc3\xa9\x00.jsonl"])
async def test_a_filename_postgres_cannot_hold_is_400_and_nothing_is_kept(api, settings, filename):
    body = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--XX\r\nContent-Disposition: form-data; name="file"; filename="' + filename
            + b'"\r\n\r\n{}\n\r\n--XX--\r\n')
    r = await api.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=XX"})
    assert_openai_error(r, 400, "file")
    assert not list((settings.data_dir / "objects").rglob("*.*")), "an object was kept"


async def test_client_text_quoted_in_an_error_stays_valid_utf8(api):
    body = '{"input_file_id": "file-\\ud800", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'
    r = await api.post("/v1/batches", **_raw(body))
    assert_openai_error(r, 404, "input_file_id")
    r.content.decode("utf-8")  # strict: the lone surrogate is not smuggled out as bytes that are not UTF-8
    assert "file-\\ud800" in json.loads(r.content)["error"]["message"]


async def test_several_greedy_choices_are_400_naming_n(api):
    body = dict(model="ballast-tiny", messages=[dict(role="user", content="hi")], n=2, temperature=0)
    assert_openai_error(await api.post("/v1/chat/completions", json=body), 400, "n", "unsupported_value")
