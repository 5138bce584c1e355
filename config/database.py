"""Where the journal's Postgres is and who logs in to it: the URLs every process builds
its connections from (no connections here)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from sqlalchemy.engine import URL, make_url

from config.section import Section

# The role the API and workers connect as: it may append to and read the journal, never
# rewrite it or change the schema. Migration 0004 creates it and grants what it needs.
SERVICE_ROLE = "ballast_service"


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
    # Two roles: migrations run as database_url's user, the owner; the API and workers
    # connect as service_role, which may append to and read the journal but never rewrite
    # it or change the schema (migration 0004 creates and grants it). Their URL is
    # service_database_url, else database_url logged in as service_role with
    # service_database_password, which the migration that creates the role sets on it
    # (`ballast up` on its embedded server, which asks every role for a password, makes
    # one unless this is set, and hands the API and workers that URL, never the owner's).
    service_role: str = SERVICE_ROLE
    service_database_url: str | None = None
    service_database_password: str | None = None

    @property
    def service_db_url(self) -> str | None:
        """What the API and workers connect with; migrations use database_url."""
        if self.service_database_url:
            return self.service_database_url
        if not self.database_url:
            return None
        return as_role(self.database_url, self.service_role, self.service_database_password)
