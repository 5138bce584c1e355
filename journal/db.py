"""Connections to the journal's Postgres."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def sync_url(url: str) -> str:
    """The SQLAlchemy URL with the psycopg (v3) driver, whatever form the user gave."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    raise ValueError(f"not a PostgreSQL URL: {url!r} (expected postgresql://user@host:port/db)")


def libpq_url(url: str) -> str:
    """The plain libpq form (`postgresql://...`), for psql and psycopg.connect."""
    return "postgresql://" + sync_url(url)[len("postgresql+psycopg://"):]


def connect(url: str, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(sync_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
