"""Alembic environment: online migrations only, against the URL the caller configured."""

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import make_url


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("No database URL: run migrations with `ballast migrate` (journal.migrate.upgrade sets it).")
    # psycopg 3 whatever driver the URL names: nothing here follows the services' code.
    engine = create_engine(make_url(url).set(drivername="postgresql+psycopg"), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=None)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
