"""Reservations in output tokens a second: `reservations.tokens_per_s`.

A reservation is either sequence slots (`slots`) or output tokens a second
(`tokens_per_s`, with `slots` 0): each engine worker of the pool turns the latter into the
slots that give that many at the pool's measured generation rate with every slot busy
(policy/reservations.py), so it grows or shrinks as the pool does. Existing rows, and
`reservation_set` events without it on a rebuild, are in slots.

Revision ID: 0032
Revises: 0031
"""

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("tokens_per_s", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    op.execute("DELETE FROM reservations WHERE slots = 0")  # in tokens a second: nothing to keep them as
    op.drop_column("reservations", "tokens_per_s")
