"""What engine workers served, found fast by the reconciler's sweep: a partial index on
`request_served` events by commit time (journal/served.py).

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX events_served ON events (committed_at) WHERE type = 'request_served'")


def downgrade() -> None:
    op.execute("DROP INDEX events_served")
