"""Reservations per region: `reservations.region` ("" for anywhere in the pool).

A reservation may name a region: its slots are then split over that region's engine
workers of the pool alone, so a tenant fenced to a region, or serving users there, has its
capacity where its requests run. Existing rows (and `reservation_set` events without a
region, on a rebuild) are the pool's, anywhere. The key becomes (tenant, model, region):
a tenant may hold one reservation per region of a pool and one anywhere in it.

Revision ID: 0030
Revises: 0029
"""

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("region", sa.Text, nullable=False, server_default=""))
    op.execute("ALTER TABLE reservations DROP CONSTRAINT reservations_pkey")
    op.execute("ALTER TABLE reservations ADD PRIMARY KEY (tenant, model, region)")


def downgrade() -> None:
    op.execute("DELETE FROM reservations WHERE region <> ''")
    op.execute("ALTER TABLE reservations DROP CONSTRAINT reservations_pkey")
    op.execute("ALTER TABLE reservations ADD PRIMARY KEY (tenant, model)")
    op.drop_column("reservations", "region")
