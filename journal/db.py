"""Connections to the journal's Postgres."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

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
    peer auth, as locally and in the embedded server)."""
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


def connect(url: str, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(sync_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def unreachable(err: BaseException) -> bool:
    """Postgres could not be reached or dropped the connection (restarting, the network):
    worth trying again, not the caller's fault."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(err, DBAPIError):
        return err.connection_invalidated or isinstance(err, (OperationalError, InterfaceError))
    return isinstance(err, OSError)
