"""The fleet controller's directive to each engine: a batch cap while its pool surges.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: no fleet cap (the engine's own policy alone decides).
    op.add_column("engines", sa.Column("batch_cap", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("engines", "batch_cap")
