"""Engine workers announce themselves (where to stream from, how loaded they are);
items count their preemptions.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Live state, overwritten every second: not journal events, and not a projection.
    op.create_table(
        "engines",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("stats", JSONB, nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.add_column("batch_items", sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("batch_items", "preemptions")
    op.drop_table("engines")
