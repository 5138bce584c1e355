"""The journal: append-only events, and the files/batches/items read models.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("stream", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False, server_default="default"),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("stream", "version", name="events_stream_version_key"),
        sa.UniqueConstraint("idempotency_key", name="events_idempotency_key_key"),
    )
    # Followers order by (txid, position) and read only below the snapshot's xmin, so a
    # row committed late with a smaller position is never skipped.
    op.execute("ALTER TABLE events ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id()")
    op.create_index("events_txid_position", "events", ["txid", "position"])
    op.create_index("events_type", "events", ["type", "position"])

    # Append-only is enforced by the database, for every role, not by convention.
    op.execute(
        """
        CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          RAISE EXCEPTION 'the journal is append-only: % on events is not allowed', TG_OP
            USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
          FOR EACH ROW EXECUTE FUNCTION events_append_only();
        CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
          FOR EACH STATEMENT EXECUTE FUNCTION events_append_only();
        REVOKE UPDATE, DELETE, TRUNCATE ON events FROM PUBLIC;
        """
    )

    op.create_table(
        "files",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("purpose", sa.Text, nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("object_key", sa.Text, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    ts = [
        sa.Column(name, sa.BigInteger)
        for name in (
            "expires_at", "in_progress_at", "finalizing_at", "completed_at",
            "failed_at", "expired_at", "cancelling_at", "cancelled_at",
        )
    ]
    op.create_table(
        "batches",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("input_file_id", sa.Text, nullable=False),
        sa.Column("completion_window", sa.Text, nullable=False),
        sa.Column("metadata", JSONB),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("errors", JSONB),
        sa.Column("output_file_id", sa.Text),
        sa.Column("error_file_id", sa.Text),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        *ts,
        # The position of the batch_created event: a total creation order for listing.
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.execute("CREATE INDEX batches_tenant_seq ON batches (tenant, seq DESC)")
    op.create_table(
        "batch_items",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("idx", sa.Integer, primary_key=True),
        sa.Column("line", sa.Integer, nullable=False),
        sa.Column("custom_id", sa.Text, nullable=False),
        sa.Column("body", JSONB, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("result_position", sa.BigInteger),
    )
    op.execute("CREATE INDEX batch_items_pending ON batch_items (batch_id, idx) WHERE status = 'pending'")


def downgrade() -> None:
    op.drop_table("batch_items")
    op.drop_table("batches")
    op.drop_table("files")
    op.drop_table("events")
    op.execute("DROP FUNCTION events_append_only()")
