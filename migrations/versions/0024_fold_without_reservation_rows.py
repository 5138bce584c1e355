"""The quota fold keeps sums only: no row per reservation.

`quota_reservations` and `quota_open` held each reservation as the fold last counted it,
so that a tick could take it out of the sums before putting it back as it stands now: two
to three rows written and deleted per request. The ledger already says how a reservation
stood at the last tick, given which of its rows that tick read; so `quota_fold` now
records the tick's own snapshot exactly (the statement that reads is the one that records
it) and, for rows the folding transaction itself writes after the fold, its id (`own`)
and the highest position it had written before (`own_position`). The two tables go.

The sums built by the earlier fold were kept against a snapshot taken before its tick
read: the `quota_fold` row is deleted, so the first fold after this rebuilds the sums from
the horizon (once, as after 0006).

Revision ID: 0024
Revises: 0023
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import SERVICE_ROLES, grant_role, service_login

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

_TABLES = ("quota_reservations", "quota_open")


def upgrade() -> None:
    op.execute("DELETE FROM quota_fold")
    op.execute("ALTER TABLE quota_fold ADD COLUMN own xid8, ADD COLUMN own_position bigint")
    for table in _TABLES:
        op.drop_table(table)


def _reservation(holder: sa.Column, *extra: sa.Column) -> list[sa.Column]:
    return [
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        holder,
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interactive", sa.Boolean, nullable=False),
        *extra,
    ]


def downgrade() -> None:
    """The tables as 0006, 0013 and 0017 left them, empty: the earlier fold rebuilds them."""
    op.create_table("quota_reservations", *_reservation(
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("input_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
    ))
    op.create_index("quota_reservations_subject", "quota_reservations", ["subject"])
    op.create_index("quota_reservations_at", "quota_reservations", ["at"])
    op.create_table("quota_open", *_reservation(
        sa.Column("holder", sa.Text, nullable=True),
        sa.Column("held", sa.BigInteger, nullable=False),
    ))
    op.create_index("quota_open_subject", "quota_open", ["subject"])
    op.create_index("quota_open_at", "quota_open", ["at"])
    op.create_index("quota_open_holder", "quota_open", ["holder"])
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    for table in _TABLES:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {quote(role)}")
        grant_role("api", "SELECT", table)
        grant_role("control", "SELECT, INSERT, UPDATE, DELETE", table)
        grant_role("engine", "SELECT", table)
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY; ALTER TABLE {table} FORCE ROW LEVEL SECURITY;"
                   f" CREATE POLICY {table}_services ON {table} TO CURRENT_USER, {quote(role)}"
                   f" USING (true) WITH CHECK (true)")
        for r in SERVICE_ROLES.values():
            op.execute(f"CREATE POLICY {table}_{r} ON {table} TO {r} USING (true) WITH CHECK (true)")
    op.execute("DELETE FROM quota_fold")
    op.execute("ALTER TABLE quota_fold DROP COLUMN own, DROP COLUMN own_position")
