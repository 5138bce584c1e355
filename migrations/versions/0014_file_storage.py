"""Files that expire and files that are deleted: `files.expires_at` (unix seconds; NULL:
kept until deleted), the indexes a tenant's listing, its storage quota and the expiry
sweep read, one that finds the open batches still reading a file, and DELETE on the
`files` read model for the services (the projection of a `file_deleted` event removes the
row; `events` itself stays append-only).

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import grant_services, service_login

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_OPEN = "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')"


def upgrade() -> None:
    op.add_column("files", sa.Column("expires_at", sa.BigInteger, nullable=True))
    op.create_index("files_tenant_created", "files", ["tenant", "created_at", "id"])
    op.create_index("files_expiry", "files", ["expires_at"], postgresql_where=sa.text("expires_at IS NOT NULL"))
    op.create_index("batches_open_input", "batches", ["input_file_id"], postgresql_where=sa.text(_OPEN))
    grant_services("DELETE", "files")


def downgrade() -> None:
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    op.execute(f"REVOKE DELETE ON files FROM {quote(role)}")
    op.drop_index("batches_open_input", "batches")
    op.drop_index("files_expiry", "files")
    op.drop_index("files_tenant_created", "files")
    op.drop_column("files", "expires_at")
