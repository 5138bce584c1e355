"""The tables the code declares (journal/schema.py) are the tables the migrations make:
every declared table and column exists after `upgrade head`, with the declared type,
nullability and defaults. What the migrations make beyond them (indexes, the fold's
tables, columns the code reaches only in SQL) is theirs alone."""

from __future__ import annotations

import warnings

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import BigInteger, Column, MetaData, Text, create_engine

from config.database import sync_url
from journal import schema


def drift(url: str, metadata: MetaData) -> list:
    """alembic's own comparison, less what the database has and the models do not declare."""
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # xid8 columns: a type SQLAlchemy does not name
            diffs = compare_metadata(MigrationContext.configure(conn, opts=dict(compare_type=True)), metadata)
    finally:
        engine.dispose()
    return [d for d in diffs if not (isinstance(d, tuple) and d[0].startswith("remove_"))]


def test_the_declared_tables_are_the_migrated_ones(db_url):
    assert drift(db_url, schema.metadata) == []


def test_drift_is_seen(db_url):
    """A column the code would write that no migration made, and a type that differs."""
    changed = MetaData()
    for table in schema.metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables["files"].append_column(Column("not_migrated", Text))
    changed.tables["engines"].c["id"].type = BigInteger()
    found = {(d[0] if isinstance(d, tuple) else d[0][0]) for d in drift(db_url, changed)}
    assert found == {"add_column", "modify_type"}
