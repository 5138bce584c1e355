"""Admin keys of no tenant: an admin principal administers Ballast and has no `/v1` of its
own, so a leaked customer key is never a global admin and an operator's key never runs a
tenant's work. Keys made before keep their tenant (and both roles) until revoked.

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column("api_keys", "tenant", nullable=True)
    op.create_check_constraint("api_keys_tenant_or_admin", "api_keys", "tenant IS NOT NULL OR admin")


def downgrade() -> None:
    op.execute("DELETE FROM api_keys WHERE tenant IS NULL")
    op.drop_constraint("api_keys_tenant_or_admin", "api_keys")
    op.alter_column("api_keys", "tenant", nullable=False)
