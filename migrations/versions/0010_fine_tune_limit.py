"""A tenant's limit on active fine-tuning jobs (`concurrent_fine_tunes`: jobs not yet
succeeded, failed or cancelled), per model or across its models ('*'), as its other limits.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("limits", sa.Column("concurrent_fine_tunes", sa.BigInteger, nullable=True))
    # The count at creation reads the tenant's active jobs: the index serves it.
    op.create_index("fine_tuning_jobs_active", "fine_tuning_jobs", ["tenant", "model"],
                    postgresql_where=sa.text("status NOT IN ('succeeded', 'failed', 'cancelled')"))


def downgrade() -> None:
    op.drop_index("fine_tuning_jobs_active", table_name="fine_tuning_jobs")
    op.drop_column("limits", "concurrent_fine_tunes")
