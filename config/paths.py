"""Where a process keeps and finds its files: the data directory, the object store every
host reaches, the models."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from config.section import Section


class PathSettings(Section):
    # Where embedded state lives: Temporal's sqlite file, embedded Postgres, objects, models.
    data_dir: Path = Path(".ballast")
    # Uploads, outputs, checkpoints.
    object_store: str | None = None  # fsspec URL; unset: data_dir/objects

    @cached_property
    def object_store_url(self) -> str:
        return self.object_store or (self.data_dir.resolve() / "objects").as_uri()

    @cached_property
    def models_dir(self) -> Path:
        return self.data_dir.resolve() / "models"
