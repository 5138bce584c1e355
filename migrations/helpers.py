"""What the migrations share, frozen with them: a migration that ran must mean the same
thing when it runs again on a new database, so nothing here follows today's code. Change
nothing a migration already uses; add a new helper beside it instead."""

from __future__ import annotations

import os

from alembic import context, op
from alembic.config import Config

# The services' role when nobody names another (config.database.SERVICE_ROLE is the same
# name today; this one stays what the migrations were written with).
SERVICE_ROLE = "ballast_service"


def service_login(cfg: Config) -> tuple[str, str | None]:
    """The services' role and its password (None: leave it as it is).

    From `journal.migrate.upgrade(service_url=…)`, else `alembic -x service_role=… -x
    service_password=…`, else BALLAST_SERVICE_ROLE / BALLAST_SERVICE_DATABASE_PASSWORD,
    else the default role.
    """
    x = (cfg.cmd_opts and getattr(cfg.cmd_opts, "x", None)) or []
    xargs = dict(a.split("=", 1) for a in x if "=" in a)

    def pick(name: str, env: str) -> str | None:
        return cfg.attributes.get(name) or xargs.get(name) or os.environ.get(env)

    role = pick("service_role", "BALLAST_SERVICE_ROLE") or SERVICE_ROLE
    return role, pick("service_password", "BALLAST_SERVICE_DATABASE_PASSWORD")


def grant_services(privileges: str, *tables: str) -> None:
    """Grant the services' role `privileges` (e.g. "SELECT, INSERT") on `tables`. Each
    migration that adds a table the services use calls it."""
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    op.execute(f"GRANT {privileges} ON {', '.join(map(quote, tables))} TO {quote(role)}")


# Each service's own role (0017 creates them): a later migration that adds a table grants
# each service what it does there, and tests/journal/test_service_roles.py holds them to it.
SERVICE_ROLES = dict(api="ballast_api", control="ballast_control", engine="ballast_engine")


def grant_role(service: str, privileges: str, *tables: str) -> None:
    """Grant service `service`'s own role `privileges` (e.g. "SELECT, INSERT") on `tables`."""
    role = SERVICE_ROLES[service]
    op.execute(f"GRANT {privileges} ON {', '.join(tables)} TO {role}")


def grant_audit_view(view: str) -> None:
    """Who reads an audit view: the services (their role and each one's API and control
    logins) and the auditor (migration 0005's role), whose row policies the view keeps
    when it is `security_invoker`."""
    grant_services("SELECT", view)
    op.execute(f"GRANT SELECT ON {view} TO ballast_auditor")
    grant_role("api", "SELECT", view)
    grant_role("control", "SELECT", view)
