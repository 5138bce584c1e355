"""Tenants, API keys, limits, the quota ledger, its audit views and the auditor role.

- `tenants`, `api_keys` (sha256 of the key, never the key), `limits` (per tenant, and per
  tenant × model; '*' is every model; NULL is no limit).
- `ledger`: append-only like `events` (same trigger). One row per reserve / settle /
  refund / expire of a request, a batch or a batch item (`subject`); `idempotency_key`
  is `<kind>:<subject>`, so a subject settles once however often it is retried.
- `quota_usage`: the reconciler's fold of the ledger, one row per tenant × model × window
  start × holder (the admitting process; '' for reservations no process holds, a
  batch's), overwritten each tick; admission reads it (bounded-stale), never the ledger.
  Per holder, so that a process adds its own admissions exactly and the others' from here.
- `admission_holders`: processes that admit, with when they were last seen; the
  reservations of one not seen for a while are expired by the reconciler.
- Views (security_invoker, so row-level security applies to whoever queries them):
  usage_by_minute / _hour / _day, open_reservations, reserved_vs_settled.
- `ballast_auditor` (NOLOGIN; grant it to a login): SELECT on the ledger, the views,
  `events` and `requests`-like read models; row-level security (FORCE) shows it only the
  rows of `current_setting('ballast.tenant')`, set per transaction
  (`SELECT set_config('ballast.tenant', 'acme', true)`), so nothing leaks between pooled
  connections: outside such a transaction it sees no rows at all.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import grant_services, service_login

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

AUDITOR = "ballast_auditor"
_TENANT_SCOPED = ("ledger", "events", "batches", "files", "quota_usage")


def _limit(name: str) -> sa.Column:
    return sa.Column(name, sa.BigInteger, sa.CheckConstraint(f"{name} IS NULL OR {name} >= 0"), nullable=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Text, primary_key=True),
        # Fair-share weight within a tier (higher: a larger share of the engines).
        sa.Column("weight", sa.Integer, sa.CheckConstraint("weight > 0"), nullable=False, server_default="1"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'", name="tenants_id_format"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Text, primary_key=True),  # key_…: how the key is named in lists and revoke
        sa.Column("tenant", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("hash", sa.Text, nullable=False, unique=True),  # sha256 hex of the whole key
        sa.Column("prefix", sa.Text, nullable=False),  # its first characters, to recognise it
        sa.Column("name", sa.Text, nullable=True),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("api_keys_tenant", "api_keys", ["tenant"])
    op.create_table(
        "limits",
        sa.Column("tenant", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("model", sa.Text, primary_key=True, server_default="*"),
        _limit("requests_per_min"),
        _limit("input_tokens_per_min"),
        _limit("output_tokens_per_min"),
        _limit("concurrent_requests"),
        _limit("tokens_per_day"),
        _limit("batch_queue_tokens"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )

    op.create_table(
        "ledger",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("tier", sa.Text, nullable=False),  # priority | default | flex | batch
        # request:<id> | batch:<id> (the enqueued reservation) | item:<id>:<idx> (an item: its journal stream)
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("input_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_tokens", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=True),  # the admitting process, for expiry
        sa.Column("idempotency_key", sa.Text, nullable=False, unique=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("kind IN ('reserve', 'settle', 'refund', 'expire')", name="ledger_kind"),
        sa.CheckConstraint("input_tokens >= 0 AND output_tokens >= 0", name="ledger_tokens"),
    )
    op.create_index("ledger_subject", "ledger", ["subject", "kind"])
    op.create_index("ledger_tenant_at", "ledger", ["tenant", "at"])
    # The reconciler's hot query: reservations still open.
    op.create_index("ledger_reserves", "ledger", ["holder", "at"], postgresql_where=sa.text("kind = 'reserve'"))
    # The fold's: reservations of the last days, by time.
    op.create_index("ledger_reserves_at", "ledger", ["at"], postgresql_where=sa.text("kind = 'reserve'"))
    op.execute(
        """
        -- One refusal for both append-only tables, naming the one refused.
        CREATE OR REPLACE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          RAISE EXCEPTION 'the journal is append-only: % on % is not allowed', TG_OP, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER ledger_no_update_delete BEFORE UPDATE OR DELETE ON ledger
          FOR EACH ROW EXECUTE FUNCTION events_append_only();
        CREATE TRIGGER ledger_no_truncate BEFORE TRUNCATE ON ledger
          FOR EACH STATEMENT EXECUTE FUNCTION events_append_only();
        REVOKE UPDATE, DELETE, TRUNCATE ON ledger FROM PUBLIC;
        """
    )

    op.create_table(
        "quota_usage",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("window", sa.Text, primary_key=True),  # minute | day
        sa.Column("starts_at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("holder", sa.Text, primary_key=True, server_default=""),
        sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("in_flight", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("batch_queue_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("folded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "admission_holders",
        sa.Column("holder", sa.Text, primary_key=True),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )

    # -- audit views: settled usage by time; reservations; reserved vs settled ------------
    for unit in ("minute", "hour", "day"):
        op.execute(
            f"""
            CREATE VIEW usage_by_{unit} WITH (security_invoker = true) AS
            SELECT tenant, model, tier, date_trunc('{unit}', at) AS {unit},
                   count(*) AS requests, sum(input_tokens) AS input_tokens,
                   sum(output_tokens) AS output_tokens, sum(input_tokens + output_tokens) AS total_tokens
              FROM ledger WHERE kind = 'settle'
             GROUP BY tenant, model, tier, date_trunc('{unit}', at)
            """
        )
    op.execute(
        """
        CREATE VIEW open_reservations WITH (security_invoker = true) AS
        SELECT r.tenant, r.model, r.tier, r.subject, r.input_tokens, r.output_tokens, r.holder, r.at
          FROM ledger r
         WHERE r.kind = 'reserve'
           AND NOT EXISTS (SELECT FROM ledger c WHERE c.subject = r.subject AND c.kind IN ('refund', 'expire', 'settle')
                           AND c.position > r.position);

        CREATE VIEW reserved_vs_settled WITH (security_invoker = true) AS
        SELECT tenant, model, tier, date_trunc('day', at) AS day,
               sum(input_tokens + output_tokens) FILTER (WHERE kind = 'reserve') AS reserved,
               sum(input_tokens + output_tokens) FILTER (WHERE kind = 'settle') AS settled,
               sum(input_tokens + output_tokens) FILTER (WHERE kind = 'refund') AS refunded,
               sum(input_tokens + output_tokens) FILTER (WHERE kind = 'expire') AS expired
          FROM ledger GROUP BY tenant, model, tier, date_trunc('day', at);
        """
    )

    grant_services("SELECT, INSERT, UPDATE", "tenants", "api_keys", "limits")
    grant_services("SELECT, INSERT", "ledger")
    grant_services("SELECT, INSERT, UPDATE, DELETE", "quota_usage", "admission_holders")

    # -- the auditor: its own tenant's rows only ----------------------------------------
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    op.execute(
        f"""
        DO $$
        BEGIN
          CREATE ROLE {AUDITOR} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
          NULL;  -- cluster-wide: another database's migration made it
        END $$;
        GRANT USAGE ON SCHEMA public TO {AUDITOR};
        """
    )
    for table in _TENANT_SCOPED:
        op.execute(
            f"""
            ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;
            ALTER TABLE {table} FORCE ROW LEVEL SECURITY;
            CREATE POLICY {table}_services ON {table} TO CURRENT_USER, {quote(role)} USING (true) WITH CHECK (true);
            CREATE POLICY {table}_auditor ON {table} FOR SELECT TO {AUDITOR}
              USING (tenant = current_setting('ballast.tenant', true));
            GRANT SELECT ON {table} TO {AUDITOR};
            """
        )
    op.execute(
        f"GRANT SELECT ON usage_by_minute, usage_by_hour, usage_by_day, open_reservations, reserved_vs_settled, "
        f"batch_items TO {AUDITOR}"
    )
    # batch_items has no tenant column: the auditor reads items through their batch.
    op.execute(
        f"""
        ALTER TABLE batch_items ENABLE ROW LEVEL SECURITY;
        ALTER TABLE batch_items FORCE ROW LEVEL SECURITY;
        CREATE POLICY batch_items_services ON batch_items TO CURRENT_USER, {quote(role)} USING (true) WITH CHECK (true);
        CREATE POLICY batch_items_auditor ON batch_items FOR SELECT TO {AUDITOR}
          USING (EXISTS (SELECT FROM batches b WHERE b.id = batch_id));
        """
    )


def downgrade() -> None:
    for table in (*_TENANT_SCOPED, "batch_items"):
        op.execute(f"DROP POLICY IF EXISTS {table}_services ON {table};"
                   f" DROP POLICY IF EXISTS {table}_auditor ON {table};"
                   f" ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY; ALTER TABLE {table} DISABLE ROW LEVEL SECURITY;")
    op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {AUDITOR}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {AUDITOR}")
    for view in ("reserved_vs_settled", "open_reservations", "usage_by_day", "usage_by_hour", "usage_by_minute"):
        op.execute(f"DROP VIEW {view}")
    for table in ("admission_holders", "quota_usage", "ledger", "limits", "api_keys", "tenants"):
        op.drop_table(table)
