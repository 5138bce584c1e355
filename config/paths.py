"""Where a process keeps and finds its files: the data directory, the object store every
host reaches, the models."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from config.section import Section


class PathSettings(Section):
    # Where this host's state lives: Temporal's sqlite file, embedded Postgres, the objects
    # (unless BALLAST_OBJECT_STORE), models, the cache of fine-tuned adapters an engine serves.
    data_dir: Path = Path(".ballast")
    # Uploads, batch outputs, fine-tuning checkpoints and adapters: what every host must reach.
    # A local directory suits one host; with separate hosts, `s3://bucket/prefix` (AWS or any
    # S3-compatible store, `pip install 'ballast[s3]'`; the bucket must exist), set by the
    # standard AWS variables: AWS_ENDPOINT_URL_S3 (an S3-compatible store), AWS_DEFAULT_REGION,
    # AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the instance's role.
    object_store: str | None = None  # fsspec URL; unset: data_dir/objects

    @cached_property
    def object_store_url(self) -> str:
        return self.object_store or (self.data_dir.resolve() / "objects").as_uri()

    @cached_property
    def models_dir(self) -> Path:
        return self.data_dir.resolve() / "models"
