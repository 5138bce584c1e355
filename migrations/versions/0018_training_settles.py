"""An index on fine-tuning's settles by time: every API process reads the day's training
tokens of every tenant at each refresh of its admission view (they count against
tokens_per_day as chat's do), and the ledger is the largest table there is.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ledger_training_at", "ledger", ["at"],
                    postgresql_where=sa.text("tier = 'training' AND kind = 'settle'"))


def downgrade() -> None:
    op.drop_index("ledger_training_at", "ledger")
