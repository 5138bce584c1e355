"""Schema changes go through Alembic only; this is how processes and tests call it.

Migrations run as the owner of the schema (`url`). They also grant the services' role
(`service_url`'s user) what the services need: each migration that adds a table calls
`grant_services` for it (see migration 0004).
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

import migrations
from journal.db import SERVICE_ROLE

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


def service_login(cfg: Config) -> tuple[str, str | None]:
    """For migrations: the services' role and its password (None: leave it as it is).

    From `upgrade(service_url=…)`, else `alembic -x service_role=… -x service_password=…`,
    else BALLAST_SERVICE_ROLE / BALLAST_SERVICE_DATABASE_PASSWORD, else the default role.
    """
    x = (cfg.cmd_opts and getattr(cfg.cmd_opts, "x", None)) or []
    xargs = dict(a.split("=", 1) for a in x if "=" in a)

    def pick(name: str, env: str, default: str | None) -> str | None:
        return cfg.attributes.get(name) or xargs.get(name) or os.environ.get(env) or default

    role = pick("service_role", "BALLAST_SERVICE_ROLE", None) or SERVICE_ROLE
    return role, pick("service_password", "BALLAST_SERVICE_DATABASE_PASSWORD", None)


def grant_services(privileges: str, *tables: str) -> None:
    """For migrations: grant the services' role `privileges` (e.g. "SELECT, INSERT") on
    `tables`. Each migration that adds a table the services use calls it."""
    from alembic import context, op

    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    op.execute(f"GRANT {privileges} ON {', '.join(map(quote, tables))} TO {quote(role)}")
