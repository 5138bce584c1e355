"""Completion windows promised and kept: `batch_promises`, one row per batch.

A batch's validation promises its completion window on its pool's measured pace, behind
the work already promised there, or fails it (policy/promises.py); a promise is a
`batch_promised` event beside the batch's own. This view puts each batch beside its
promise and its outcome, so whether promises are kept is a query:

- `promised_by`: its window's end (`expires_at`); `estimated_at`, `ahead`, `rate`: when the
  pool's schedule would finish it, the output tokens due no later (its own included) and
  the pace (tokens a second) the promise was made on (NULL: no promise; `estimated_at`
  NULL also for a best-effort promise on a pool whose pace was not measured yet);
- `kept`: true for a batch that completed, false for one that expired (its window passed
  first), NULL while it runs or for one failed or cancelled.

Read by the services' consoles and the auditor; `security_invoker`, so the tables' row
policies hold (the auditor sees its tenant's batches only).

Revision ID: 0027
Revises: 0026
"""

from alembic import op

from migrations.helpers import grant_audit_view

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The key's ':' stands apart from 'promised': op.execute would take the two together
    # for a bind parameter.
    op.execute("""
        CREATE VIEW batch_promises WITH (security_invoker = true) AS
        SELECT b.id AS batch_id, b.tenant, b.model, b.completion_window, b.status,
               b.created_at, b.expires_at AS promised_by,
               (p.payload->>'estimated_at')::double precision AS estimated_at,
               (p.payload->>'ahead')::bigint AS ahead,
               (p.payload->>'rate')::double precision AS rate,
               coalesce(b.completed_at, b.expired_at, b.failed_at, b.cancelled_at) AS ended_at,
               CASE b.status WHEN 'completed' THEN true WHEN 'expired' THEN false END AS kept
          FROM batches b
          LEFT JOIN events p ON p.idempotency_key = 'batch:' || b.id || ':' || 'promised'
    """)
    grant_audit_view("batch_promises")


def downgrade() -> None:
    op.execute("DROP VIEW batch_promises")
