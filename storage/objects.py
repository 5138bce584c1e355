"""File bytes live in an object store, never in Postgres rows or Temporal history.

A local directory by default; any fsspec URL (s3://bucket/prefix, gs://...) in production.
Objects are written under a temporary name and moved into place, so a reader never sees
half an object and a retried writer simply replaces it with the same bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import fsspec


class ObjectStore:
    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        if ".." in key.split("/") or key.startswith("/"):
            raise ValueError(f"bad object key {key!r}")
        return f"{self.root.rstrip('/')}/{key}"

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        final = self._path(key)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        parent = final.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, final)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)

    def open(self, key: str) -> BinaryIO:
        return self.fs.open(self._path(key), "rb")

    def size(self, key: str) -> int:
        return self.fs.size(self._path(key))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))
