"""A settle releases what its reservation held beyond it: `reserved_vs_settled` says so.

A request's settle was followed by a `refund` row of what its reservation held beyond
what it used: a third ledger row for almost every request (one that stops before
max_tokens, or that reserved the rest of the context), which nothing but this view read.
The settle closes the reservation already, so the journaling transaction no longer
writes that refund (journal/ledger.py). The view's `refunded` now adds, for each settle
of a reservation with no refund row of its own, what the reservation held beyond it,
dimension by dimension, as the refund row said: the same figures for journals of either
kind. `refund` rows remain for reservations closed unsettled (a batch at its end, a
request no engine took).

Revision ID: 0026
Revises: 0025
"""

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_HEAD = """
    CREATE OR REPLACE VIEW reserved_vs_settled WITH (security_invoker = true) AS
    SELECT l.tenant, l.model, l.tier, date_trunc('day', l.at) AS day,
           sum(l.input_tokens + l.output_tokens) FILTER (WHERE l.kind = 'reserve') AS reserved,
           sum(l.input_tokens + l.output_tokens) FILTER (WHERE l.kind = 'settle') AS settled,
"""
_TAIL = """
           sum(l.input_tokens + l.output_tokens) FILTER (WHERE l.kind = 'expire') AS expired
"""


def upgrade() -> None:
    op.execute(
        _HEAD
        + """
           sum(CASE WHEN l.kind = 'refund' THEN l.input_tokens + l.output_tokens ELSE s.released END) AS refunded,
        """
        + _TAIL
        + """
      FROM ledger l
      LEFT JOIN LATERAL (  -- two probes of the key index, settles only
        SELECT greatest(r.input_tokens - l.input_tokens, 0) + greatest(r.output_tokens - l.output_tokens, 0)
               AS released
          FROM ledger r
         WHERE l.kind = 'settle' AND r.idempotency_key = 'reserve:' || l.subject
           AND NOT EXISTS (SELECT FROM ledger f WHERE f.idempotency_key = 'refund:' || l.subject)
      ) s ON true
     GROUP BY l.tenant, l.model, l.tier, date_trunc('day', l.at)
    """
    )


def downgrade() -> None:
    op.execute(
        _HEAD
        + """
           sum(l.input_tokens + l.output_tokens) FILTER (WHERE l.kind = 'refund') AS refunded,
        """
        + _TAIL
        + """
      FROM ledger l GROUP BY l.tenant, l.model, l.tier, date_trunc('day', l.at)
    """
    )
