"""A batch's model is its input file's first request's, read with plain bounded reads (an
object store's file may offer nothing else)."""

from __future__ import annotations

import io
import json

import pytest

from api.batches import FIRST_LINE_BYTES, first_model


class ReadOnly:
    """A file with read() alone, as some object stores give."""

    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        out = self._f.read(n)
        self.read_bytes += len(out)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class Store:
    def __init__(self, data: bytes):
        self.file = ReadOnly(data)

    def open(self, key: str) -> ReadOnly:
        return self.file


def line(model, **more) -> bytes:
    return json.dumps(dict(custom_id="a", method="POST", url="/v1/chat/completions",
                           body=dict(model=model, messages=[], **more))).encode()


@pytest.mark.parametrize("data, model", [
    (line("m-b") + b"\n" + line("m-a") + b"\n", "m-b"),
    (b"\n\n  \n" + line("m-b"), "m-b"),  # blank lines first, no newline at the end
    (line("m-b") + b"\r\n", "m-b"),
    (b"not json\n" + line("m-b"), None),
    (b"[1, 2]\n", None),
    (json.dumps(dict(body="text")).encode(), None),
    (b"", None),
])
def test_the_first_request_names_the_model(data, model):
    assert first_model(Store(data), "k") == model


def test_a_huge_first_line_is_read_only_so_far():
    store = Store(line("m-b", pad="x" * (4 * FIRST_LINE_BYTES)) + b"\n")
    assert first_model(store, "k") is None
    assert store.file.read_bytes == FIRST_LINE_BYTES
    short = Store(line("m-b") + b"\n" + b"x" * (4 * FIRST_LINE_BYTES))
    assert first_model(short, "k") == "m-b"
    assert short.file.read_bytes <= 64 << 10
