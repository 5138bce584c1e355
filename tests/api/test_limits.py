"""Request bodies are capped while they are read, Content-Length or chunked; nothing of a
refused upload is kept."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from sqlalchemy import func, select

from api.app import UPLOAD_SLACK, LimitBody, _TooLarge
from journal.schema import files
from tests.api.conftest import REQUEST_LIMIT, UPLOAD_LIMIT, assert_openai_error, build


def chunked(total: int, piece: int = 4096):
    """An httpx generator body: sent with Transfer-Encoding: chunked, no Content-Length."""

    async def gen():
        sent = 0
        while sent < total:
            n = min(piece, total - sent)
            yield b" " * n
            sent += n

    return gen()


def multipart(size: int, piece: int = 16384):
    async def gen():
        yield b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--XX\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        for i in range(0, size, piece):
            yield b"x" * min(piece, size - i)
        yield b"\r\n--XX--\r\n"

    return gen()


MULTIPART = {"content-type": "multipart/form-data; boundary=XX"}
JSON = {"content-type": "application/json"}


async def _file_rows(db) -> int:
    async with db.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(files))).scalar_one()


def _objects(settings) -> list:
    return [p for p in (settings.data_dir / "objects").rglob("*") if p.is_file()]


async def test_a_chunked_chat_body_over_the_limit_is_413(api):
    r = await api.post("/v1/chat/completions", content=chunked(REQUEST_LIMIT + 1), headers=JSON)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, code="request_too_large")


async def test_a_declared_length_over_the_limit_is_413_before_reading(api):
    r = await api.post("/v1/batches", content=b" " * (REQUEST_LIMIT + 1), headers=JSON)
    assert_openai_error(r, 413, code="request_too_large")


async def test_a_chunked_body_within_the_limit_goes_through(api):
    async def body():
        yield b'{"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", '
        yield b'"completion_window": "24h"}'

    assert_openai_error(await api.post("/v1/batches", content=body(), headers=JSON), 404, "input_file_id")


async def test_a_chunked_upload_over_the_limit_is_413_and_nothing_is_kept(api, settings, db):
    before = await _file_rows(db)
    r = await api.post("/v1/files", content=multipart(UPLOAD_LIMIT + UPLOAD_SLACK + 1), headers=MULTIPART)
    assert_openai_error(r, 413, "file", "file_too_large")
    assert await _file_rows(db) == before and not _objects(settings)


async def test_a_chunked_upload_within_the_slack_but_over_the_file_limit_is_413_and_nothing_is_kept(api, settings, db):
    before = await _file_rows(db)
    r = await api.post("/v1/files", content=multipart(UPLOAD_LIMIT + 1), headers=MULTIPART)
    assert_openai_error(r, 413, "file", "file_too_large")
    assert await _file_rows(db) == before and not _objects(settings)


async def test_an_upload_at_the_limit_is_kept(api, settings):
    r = await api.post("/v1/files", content=multipart(UPLOAD_LIMIT), headers=MULTIPART)
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == UPLOAD_LIMIT and len(_objects(settings)) == 1


async def test_a_response_already_begun_is_not_followed_by_a_second():
    """An app that answers before it reads: the cut-off reaches it as an error, and the
    server (not a second response) ends the exchange."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive()).get("more_body"):
            pass

    body = [{"type": "http.request", "body": b"x" * 10, "more_body": True}] * 5

    async def receive():
        return body.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    with pytest.raises(_TooLarge):  # the cut-off, re-raised: a response had begun
        await LimitBody(app, upload_limit=100, request_limit=25)(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"] and sent[0]["status"] == 200
    assert len(body) == 2  # stopped reading at the cap


async def test_a_small_declared_length_does_not_let_a_larger_body_through():
    """Content-Length 10 beside a body of 125 bytes (what h11 reads when Transfer-Encoding:
    chunked is sent too): the count, not the declaration, decides."""
    sent, read = [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            read.append(len(message["body"]))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    body = [{"type": "http.request", "body": b"x" * 25, "more_body": True}] * 5

    async def receive():
        return body.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-length", b"10"), (b"transfer-encoding", b"chunked")]}
    await LimitBody(app, upload_limit=1000, request_limit=60)(scope, receive, send)
    assert sent[0]["status"] == 413 and sum(read) <= 75


async def test_only_a_multipart_upload_gets_the_uploads_allowance(api):
    """A form-urlencoded body is parsed in memory whole: to /v1/files it gets what any
    request gets, not the upload's allowance."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = await api.post("/v1/files", content=chunked(REQUEST_LIMIT + 1), headers=form)
    assert_openai_error(r, 413, code="request_too_large")
    r = await api.post("/v1/files", content=b"a=" + b"x" * REQUEST_LIMIT, headers=form)
    assert_openai_error(r, 413, code="request_too_large")


@contextlib.asynccontextmanager
async def serve(settings, db, temporal, key, http="auto"):
    """The app behind a real uvicorn socket: chunked transfer encoding, HTTP framing."""
    import uvicorn

    in_process = build(settings, db, temporal, key)
    app, headers = in_process._transport.app, in_process.headers
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning",
                                           http=http))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=headers) as client:
            yield client
    finally:
        server.should_exit = True
        await task


async def test_over_a_real_socket(settings, db, default_key):
    from tests.api.conftest import Untouchable

    async with serve(settings, db, Untouchable("temporal"), default_key) as http:
        # Chunked, well past the cap: the client still reads the 413.
        r = await http.post("/v1/chat/completions", content=chunked(40 * REQUEST_LIMIT, 65536), headers=JSON)
        assert "content-length" not in r.request.headers
        assert_openai_error(r, 413, code="request_too_large")
        r = await http.post("/v1/files", content=multipart(4 * UPLOAD_LIMIT), headers=MULTIPART)
        assert_openai_error(r, 413, "file", "file_too_large")
        assert not _objects(settings)
        # And the connection is still good for the next request.
        assert_openai_error(await http.get("/v1/files/file-%00/content"), 404, "file_id")
        assert_openai_error(await http.get("/v1/files/%00"), 404, "file_id")



async def test_content_length_beside_chunked_over_a_real_socket(settings, db, default_key):
    """The request smuggling shape: a small Content-Length and Transfer-Encoding: chunked.
    h11 (uvicorn's pure-Python parser) reads the chunks; the cap still holds."""
    from tests.api.conftest import Untouchable

    async with serve(settings, db, Untouchable("temporal"), default_key, http="h11") as http:
        port = int(str(http.base_url).rsplit(":", 1)[1].strip("/"))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: {http.headers['authorization']}\r\nContent-Type: application/json\r\n"
                "Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(head.encode())
        chunk = b" " * 65536
        try:
            for _ in range(4 * REQUEST_LIMIT // len(chunk) + 1):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass  # the server answered and closed before the rest was sent
        status = (await asyncio.wait_for(reader.readline(), 30)).decode()
        writer.close()
    # Not the app's 400 for a body it read whole (4x the cap of spaces is not JSON): the cap's.
    assert status.split()[1] == "413", status


async def test_a_body_that_stops_arriving_is_408_over_a_real_socket(settings, db, default_key):
    """A client that sends part of its body and then nothing (slowloris) gets a 408 once the
    read timeout passes, not a connection held open for as long as it likes."""
    from tests.api.conftest import Untouchable

    quick = settings.model_copy(update=dict(request_read_timeout_s=0.5))
    async with serve(quick, db, Untouchable("temporal"), default_key, http="h11") as http:
        port = int(str(http.base_url).rsplit(":", 1)[1].strip("/"))
        upload_head = b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"custom'
        for path, kind, part in (("/v1/chat/completions", "application/json", b'{"model": "ballast-tiny", '),
                                 ("/v1/files", MULTIPART["content-type"], upload_head)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {http.headers['authorization']}\r\n"
                          f"Content-Type: {kind}\r\nContent-Length: 1000\r\n\r\n").encode() + part)
            await writer.drain()
            status = (await asyncio.wait_for(reader.readline(), 10)).decode()
            rest = await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            assert status.split()[1] == "408", (path, status)
            assert b'"code":"request_timeout"' in rest, rest
        assert not _objects(settings)
        # A body sent whole, however slowly overall, is not cut.
        assert_openai_error(await http.get("/v1/files/%00"), 404, "file_id")
