"""Schema changes go through Alembic only; this is how processes and tests call it."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

_MIGRATIONS = Path(migrations.__file__).parent


def alembic_config(url: str) -> Config:
    cfg = Config(str(_MIGRATIONS / "alembic.ini"))
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)
