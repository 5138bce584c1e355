"""A shared fleet's cost apportioned to tenants: `cost_by_tenant`, a row per pool (model),
hour and tenant, from the ledger's settles (what each request, batch item and training
chunk really used):

- `input_tokens`, `output_tokens`: the tokens it used; `token_share`: its share of the
  pool's tokens in that hour;
- `kv_token_steps`: its KV-cache occupancy in token-steps. A sequence with p prompt tokens
  that generates n holds p + k tokens of KV at its k-th decode step: n·p + n(n+1)/2 over
  its life. `kv_share`: its share of the pool's in that hour — the share of the engines'
  memory-time it held, which is what decode time grows with under continuous batching.

Apportion an hour of a pool's engines (its bill) by `kv_share` for generation-heavy work,
by `token_share` where prefill dominates; a training chunk's settle has no output tokens,
so it counts in `token_share` only. A preempted item that was prefilled again counts once.

`security_invoker`, so the ledger's row policies hold: an operator sees every tenant and
the true shares; the auditor sees its tenant's rows only, its shares then of its own usage
(another tenant's volume is not shown to it).

Revision ID: 0028
Revises: 0027
"""

from alembic import op

from migrations.helpers import grant_audit_view

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE VIEW cost_by_tenant WITH (security_invoker = true) AS
        WITH used AS (
          SELECT model, date_trunc('hour', at) AS hour, tenant,
                 sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,
                 sum(input_tokens * output_tokens + output_tokens * (output_tokens + 1) / 2) AS kv_token_steps
            FROM ledger
           WHERE kind = 'settle'
           GROUP BY 1, 2, 3
        )
        SELECT model, hour, tenant, input_tokens, output_tokens, kv_token_steps,
               (input_tokens + output_tokens)::double precision
                 / nullif(sum(input_tokens + output_tokens) OVER pool, 0) AS token_share,
               kv_token_steps::double precision / nullif(sum(kv_token_steps) OVER pool, 0) AS kv_share
          FROM used
        WINDOW pool AS (PARTITION BY model, hour)
    """)
    grant_audit_view("cost_by_tenant")


def downgrade() -> None:
    op.execute("DROP VIEW cost_by_tenant")
