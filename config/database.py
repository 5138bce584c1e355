"""Where the journal's Postgres is and who logs in to it: the URLs every process builds
its connections from (no connections here)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from sqlalchemy.engine import URL, make_url

from config.section import Section

# The role the API and workers connect as: it may append to and read the journal, never
# rewrite it or change the schema. Migration 0004 creates it and grants what it needs.
SERVICE_ROLE = "ballast_service"
# The role of each service (migration 0017), each granted only what that service does. A
# process logs in as one of them through BALLAST_SERVICE_DATABASE_URL, which its
# deployment hands it; `ballast migrate` sets their passwords.
SERVICE_ROLES = dict(api="ballast_api", control="ballast_control", engine="ballast_engine")


def sync_url(url: str) -> str:
    """`postgresql+psycopg://…` (psycopg 3) for SQLAlchemy, from any Postgres URL form."""
    return _with_driver(url, "postgresql+psycopg")


def libpq_url(url: str) -> str:
    """Plain `postgresql://…` for psql and psycopg.connect, from any Postgres URL form."""
    return _with_driver(url, "postgresql")


def as_role(url: str, role: str, password: str | None = None) -> str:
    """The same server and database as `url`, logged in as `role` (no password: trust or
    peer auth)."""
    u = make_url(url)
    # URL.set keeps the old password when given None; build it afresh instead.
    return URL.create(u.drivername, role, password, u.host, u.port, u.database, u.query).render_as_string(
        hide_password=False
    )


def _with_driver(url: str, driver: str) -> str:
    u = make_url(url)
    if u.drivername.split("+")[0] not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: {u.render_as_string()} (expected postgresql://user@host:port/db)")
    return u.set(drivername=driver).render_as_string(hide_password=False)


class DatabaseSettings(Section):
    # Postgres. Unset: `ballast up` starts an embedded server under data_dir.
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BALLAST_DATABASE_URL", "DATABASE_URL")
    )
    # Migrations run as database_url's user, the owner. A service process connects with
    # service_database_url: its deployment hands each service its own role's URL
    # (SERVICE_ROLES; docs/deployment.md#postgres-roles-and-secrets). Unset, it is
    # database_url logged in as service_role with service_database_password: the one role
    # every service shared before each had its own (migration 0004 makes it; the tests
    # that run every service in one process use it).
    service_role: str = SERVICE_ROLE
    service_database_url: str | None = None
    service_database_password: str | None = None
    # Each service's own role's password: `ballast migrate` sets each one given here on its
    # role, and `ballast up` hands each service its own (made and kept in data_dir where
    # unset). Only migrate is handed them: a service gets its URL alone.
    api_database_password: str | None = None
    control_database_password: str | None = None
    engine_database_password: str | None = None

    @property
    def service_db_url(self) -> str | None:
        """What the API and workers connect with; migrations use database_url."""
        if self.service_database_url:
            return self.service_database_url
        if not self.database_url:
            return None
        return as_role(self.database_url, self.service_role, self.service_database_password)

    def role_passwords(self) -> dict[str, str]:
        """{role: password} of each service's role whose password is set here."""
        return {role: pw for kind, role in SERVICE_ROLES.items() if (pw := self.role_password(kind))}

    def role_password(self, kind: str) -> str | None:
        """The password set here for service `kind`'s own role."""
        return getattr(self, f"{kind}_database_password")
