"""Fine-tuning jobs: a read model of the `ft_job_created` and `ft_status` events (their
checkpoints and user-visible events stay in `events`, stream `ftjob:<id>`).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from migrations.helpers import grant_services

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("training_file", sa.Text, nullable=False),
        sa.Column("validation_file", sa.Text),
        sa.Column("hyperparameters", JSONB, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("suffix", sa.Text),
        sa.Column("metadata", JSONB),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("error", JSONB),
        sa.Column("fine_tuned_model", sa.Text),
        sa.Column("trained_tokens", sa.BigInteger),
        sa.Column("result_files", JSONB, nullable=False, server_default="[]"),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("finished_at", sa.BigInteger),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.create_index("fine_tuning_jobs_tenant_seq", "fine_tuning_jobs", ["tenant", sa.text("seq DESC")])
    grant_services("SELECT, INSERT, UPDATE", "fine_tuning_jobs")


def downgrade() -> None:
    op.drop_table("fine_tuning_jobs")
