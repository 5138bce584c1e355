"""A pool of engine workers: an engine can be drained (it takes no new work; what runs
there finishes or moves), and a tenant can be fenced to regions (its work runs nowhere
else).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("engines", sa.Column("draining", sa.Boolean, nullable=False, server_default="false"))
    # NULL: anywhere. The regions an engine worker may be in (BALLAST_REGION) for this tenant.
    op.add_column("tenants", sa.Column("regions", ARRAY(sa.Text), nullable=True))


def downgrade() -> None:
    op.drop_column("tenants", "regions")
    op.drop_column("engines", "draining")
