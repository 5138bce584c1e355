"""The service tiers a tenant is granted beyond the open ones. `priority` runs ahead of every
other tenant's work and may use all of a limit, so it is granted (`ballast tenants tiers`,
the admin API), never taken: every tenant starts with none, existing ones included. A
request asking for a tier its tenant lacks runs at `default`, and its response says so.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("tiers", ARRAY(sa.Text), nullable=False, server_default="{}"))
    op.create_check_constraint("tenants_tiers_grantable", "tenants", "tiers <@ ARRAY['priority']::text[]")


def downgrade() -> None:
    op.drop_constraint("tenants_tiers_grantable", "tenants")
    op.drop_column("tenants", "tiers")
