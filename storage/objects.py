"""File bytes live in an object store, never in Postgres rows or Temporal history.

A local directory by default, which only the processes of one host reach; `s3://bucket/prefix`
(AWS S3 or any S3-compatible store) when the API, control and engine hosts are separate
machines: every host reaches it, and none needs a shared filesystem. The endpoint, region
and credentials come from the standard AWS variables (AWS_ENDPOINT_URL_S3,
AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or an instance role), as for
every other S3 client. Other fsspec URLs (gs://, ...) take the S3 path below, untested.

A reader never sees half an object, and a retried writer simply replaces it with the same
bytes, or leaves what was there when it fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem


class ObjectStore:
    def __init__(self, url: str):
        # No listings cache: objects appear that other hosts wrote, and a listing cached here
        # before they did would call them missing.
        self.fs, self.root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        elif not self.fs.exists(bucket := self.root.split("/", 1)[0]):
            # Never created here: its region, access policy and lifecycle are the operator's.
            raise FileNotFoundError(
                f"The object store's bucket {bucket!r} ({url}) does not exist or cannot be reached with these "
                f"credentials: create it (for S3: `aws s3 mb s3://{bucket}`), or check BALLAST_OBJECT_STORE, "
                "AWS_ENDPOINT_URL_S3 and the AWS credentials.")

    def _path(self, key: str) -> str:
        # Relative, without empty or dot segments: a local directory and a bucket then agree
        # on what a key names, and no key reaches outside the root.
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"bad object key {key!r}")
        return f"{self.root.rstrip('/')}/{key}"

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        final = self._path(key)
        if not self.local:
            # Straight to the key: an upload appears only when committed, whole (a PUT is
            # atomic, and a rename would be a copy and a delete). A failed writer's upload is
            # aborted, leaving whatever was there before.
            f = self.fs.open(final, "wb", autocommit=False)
            try:
                with f:
                    yield f
                f.commit()
            except BaseException:
                f.discard()
                raise
            return
        # A file is visible while it is written: write it under a temporary name and rename
        # it into place, which is atomic.
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
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

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these objects; one already gone is fine (a retried delete finds less)."""
        paths = [self._path(k) for k in keys]
        if not self.local and paths:
            try:
                self.fs.rm(paths)  # on S3 one bulk request per 1,000 keys; a key that is not there is no error
                return
            except FileNotFoundError:
                pass  # some were gone already: one by one below
        for path in paths:
            try:
                self.fs.rm(path)
            except FileNotFoundError:
                pass
