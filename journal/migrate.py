"""Schema changes go through Alembic only; this is how processes and tests call it.

Migrations run as the owner of the schema (`url`). They also grant the services' role
(`service_url`'s user) what the services need: each migration that adds a table calls
`grant_services` for it (migrations/helpers.py).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

import migrations

_MIGRATIONS = Path(migrations.__file__).parent


def alembic_config(url: str, service_url: str | None = None) -> Config:
    cfg = Config(str(_MIGRATIONS / "alembic.ini"))
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if service_url:
        u = make_url(service_url)
        cfg.attributes.update(service_role=u.username, service_password=u.password)
    return cfg


def upgrade(url: str, revision: str = "head", *, service_url: str | None = None) -> None:
    command.upgrade(alembic_config(url, service_url), revision)
