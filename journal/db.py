"""Connections to the journal's Postgres."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from config.database import sync_url


def connect(url: str, *, pool_size: int = 10, name: str | None = None, pre_ping: bool = True) -> AsyncEngine:
    """`name`: the application_name its sessions show in pg_stat_activity and the server's
    log, so an operator tells the API's connections from each worker's."""
    args = dict(application_name=name) if name else {}
    return create_async_engine(sync_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=pre_ping,
                               connect_args=args)


def unreachable(err: BaseException) -> bool:
    """Postgres could not be reached or dropped the connection (restarting, the network):
    worth trying again, not the caller's fault."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(err, DBAPIError):
        return err.connection_invalidated or isinstance(err, (OperationalError, InterfaceError))
    return isinstance(err, OSError)
