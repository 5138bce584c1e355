"""The quota fold, incremental: what it has folded, so that a tick reads only what changed
(journal/ledger.py, "the reconciler").

- `ledger.txid`: the writing transaction's id (as `events.txid`, migration 0001). The fold
  keeps the snapshot it last read under (`quota_fold`): a row whose transaction that
  snapshot did not see as ended (txid ≥ its xmax, or among its in-progress ids) is new to
  the fold, however late it commits; the fold has read every other row already. Rows from
  before this migration have none (NULL): the first fold after it reads the horizon whole.
- `quota_reservations`: each reservation of the current day or minute (from the earlier of
  the day's start and the previous minute's), as it stood when the fold last read a row of
  its subject: what it counts for (`input_tokens`, `output_tokens`: reserved while open,
  used once settled, 0 once refunded or expired unsettled).
- `quota_open`: each open reservation of the horizon, and what it holds; `quota_open_sums`
  its sums per tenant × model × holder (in_flight, batch_queue_tokens), kept by the same
  differences, and as reservations leave the horizon.
- `quota_buckets`: the sums of `quota_reservations` per tenant × model × holder × window
  (minute, day) × start, for the current and later windows; `reservations` counts every
  tier (a day row exists for a holder with any reservation that day), the other figures
  interactive ones only. A tick adds what it changed, as differences.
- `quota_fold`: one row, the snapshot of the last fold.
Nothing outside the fold reads them; admission reads `quota_usage` as before.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

from migrations.helpers import grant_services

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def _reservation(holder: sa.Column, *extra: sa.Column) -> list[sa.Column]:
    # No unique key: a tick deletes a subject's rows and inserts them anew in one statement
    # (sibling CTEs, which do not see each other's rows).
    return [
        sa.Column("position", sa.BigInteger, nullable=False),  # the reserve row's
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        holder,
        sa.Column("at", _TS, nullable=False),
        sa.Column("interactive", sa.Boolean, nullable=False),
        *extra,
    ]


def upgrade() -> None:
    # No default for the rows already there (that would rewrite the table): NULL is "before
    # the fold kept a snapshot", and the first fold reads those from the horizon anyway.
    op.execute("ALTER TABLE ledger ADD COLUMN txid xid8")
    op.execute("ALTER TABLE ledger ALTER COLUMN txid SET DEFAULT pg_current_xact_id()")
    op.create_index("ledger_txid", "ledger", ["txid"])

    op.create_table("quota_reservations", *_reservation(
        sa.Column("holder", sa.Text, nullable=False),  # '' for none, as in quota_usage
        sa.Column("input_tokens", sa.BigInteger, nullable=False),  # what it counts for
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
    ))
    op.create_index("quota_reservations_subject", "quota_reservations", ["subject"])
    op.create_index("quota_reservations_at", "quota_reservations", ["at"])
    op.create_table("quota_open", *_reservation(
        sa.Column("holder", sa.Text, nullable=True),  # the ledger's: expiry passes over NULL, not ''
        sa.Column("held", sa.BigInteger, nullable=False),  # what it reserved
    ))
    op.create_index("quota_open_subject", "quota_open", ["subject"])
    op.create_index("quota_open_at", "quota_open", ["at"])
    op.create_index("quota_open_holder", "quota_open", ["holder"])
    op.create_table(
        "quota_open_sums",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, primary_key=True),
        sa.Column("reservations", sa.BigInteger, nullable=False),  # every tier
        sa.Column("in_flight", sa.BigInteger, nullable=False),
        sa.Column("batch_queue_tokens", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "quota_buckets",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, primary_key=True),
        sa.Column("window", sa.Text, primary_key=True),  # minute | day
        sa.Column("starts_at", _TS, primary_key=True),
        sa.Column("reservations", sa.BigInteger, nullable=False),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("input_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
    )
    op.create_index("quota_buckets_window", "quota_buckets", ["window", "starts_at"])
    op.execute(
        """
        CREATE TABLE quota_fold (
          id boolean PRIMARY KEY DEFAULT true CHECK (id),  -- one row
          -- The last fold's snapshot: every transaction below `below` had ended, but those
          -- `in_progress` (its own added); xmax and xip in pg_snapshot's words.
          below xid8 NOT NULL,
          in_progress xid8[] NOT NULL,
          folded_at timestamptz NOT NULL
        )
        """
    )
    grant_services("SELECT, INSERT, UPDATE, DELETE", "quota_reservations", "quota_open", "quota_open_sums",
                   "quota_buckets", "quota_fold")


def downgrade() -> None:
    for table in ("quota_fold", "quota_buckets", "quota_open_sums", "quota_open", "quota_reservations"):
        op.drop_table(table)
    op.drop_index("ledger_txid", table_name="ledger")
    op.execute("ALTER TABLE ledger DROP COLUMN txid")
