"""A fine-tuned model deleted by its tenant (DELETE /v1/models/{model}): when, on its job's
row. The job and its history stay (the journal keeps its audit trail); the model is no
longer listed or callable, and its adapter and checkpoints leave the object store.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("model_deleted_at", sa.BigInteger, nullable=True))


def downgrade() -> None:
    op.drop_column("fine_tuning_jobs", "model_deleted_at")
