"""Regional allowances: a cell's share of a tenant's global daily tokens, and who sets it.

Where regions are cells (each its own journal), a tenant's global `tokens_per_day` is split
into one allowance per cell; a reconciler outside every cell rebalances them on a timer
(`ballast cells reconcile`). `allowances` is their history, append-only like the ledger:
one row each time a cell's allowance for a tenant × model changes, with the global limit
and the cell's usage it was computed from. `allowances_in_force` holds the latest per tenant
× model, written with its history row in one statement: admission applies it as that
scope's `tokens_per_day` (the lesser, where the cell's own `limits` also bound it); one with
no `tokens_per_day` lifts it.

`ballast_cells` (NOLOGIN; grant it to the reconciler's login in each cell) reads the fold's
usage and when it last ran (`quota_usage`, `quota_fold`), training's settles (`ledger`) and
what the engines announce (`engines`, not their URLs: the cell's capacity, for routing
weights), settled usage by day (`usage_by_day`, for audits across cells) and, for routing
a fenced tenant's requests to its regions at the edge, which key hash is whose and each
tenant's regions (`api_keys`: the hash, never a key; `tenants`), and appends allowances;
nothing else. The services read allowances (they admit against them); the auditor reads its
tenant's.

Revision ID: 0031
Revises: 0030
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import SERVICE_ROLES, grant_services, service_login

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

API, CONTROL, ENGINE = (SERVICE_ROLES[k] for k in ("api", "control", "engine"))
AUDITOR = "ballast_auditor"  # 0005
CELLS = "ballast_cells"


def upgrade() -> None:
    op.create_table(
        "allowances",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),  # '*': all the tenant's models
        sa.Column("tokens_per_day", sa.BigInteger),  # NULL: no allowance (the global limit lifted)
        sa.Column("global_tokens_per_day", sa.BigInteger),
        sa.Column("used", sa.BigInteger, nullable=False, server_default="0"),  # the cell's, as read
        sa.Column("tick", sa.Text, nullable=False),  # the reconciler's tick that set it
        sa.Column("set_by", sa.Text, nullable=False, server_default=sa.text("current_user")),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("tokens_per_day IS NULL OR tokens_per_day >= 0", name="allowances_not_negative"),
    )
    op.create_index("allowances_by_scope", "allowances", ["tenant", "model", sa.text("id DESC")])
    # The one in force per tenant × model, written with its history row in one statement:
    # what admission reads every refresh, whatever the length of the history.
    op.create_table(
        "allowances_in_force",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("tokens_per_day", sa.BigInteger),
        sa.Column("id", sa.BigInteger, nullable=False),  # its `allowances` row
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
    )
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    grant_services("SELECT", "allowances", "allowances_in_force")
    op.execute(
        f"""
        CREATE TRIGGER allowances_no_update_delete BEFORE UPDATE OR DELETE ON allowances
          FOR EACH ROW EXECUTE FUNCTION events_append_only();
        CREATE TRIGGER allowances_no_truncate BEFORE TRUNCATE ON allowances
          FOR EACH STATEMENT EXECUTE FUNCTION events_append_only();
        REVOKE UPDATE, DELETE, TRUNCATE ON allowances FROM PUBLIC;
        DO $$
        BEGIN
          CREATE ROLE {CELLS} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
          NULL;  -- cluster-wide: another database's migration made it
        END $$;
        DO $$
        BEGIN
          EXECUTE format('GRANT CONNECT ON DATABASE %I TO {CELLS}', current_database());
        END $$;
        GRANT USAGE ON SCHEMA public TO {CELLS};
        GRANT SELECT ON quota_usage, quota_fold, ledger, usage_by_day TO {CELLS};
        GRANT SELECT, INSERT ON allowances TO {CELLS};
        GRANT SELECT, INSERT, UPDATE ON allowances_in_force TO {CELLS};
        GRANT SELECT ON allowances_in_force TO {API}, {CONTROL}, {ENGINE}, {AUDITOR};
        GRANT SELECT (id, model, stats, seen_at, draining) ON engines TO {CELLS};
        CREATE POLICY engines_{CELLS} ON engines FOR SELECT TO {CELLS} USING (true);
        GRANT SELECT (hash, tenant, revoked_at) ON api_keys TO {CELLS};
        CREATE POLICY api_keys_{CELLS} ON api_keys FOR SELECT TO {CELLS} USING (true);
        GRANT SELECT (id, regions) ON tenants TO {CELLS};
        GRANT SELECT ON allowances TO {API}, {CONTROL}, {ENGINE}, {AUDITOR};
        CREATE POLICY quota_usage_{CELLS} ON quota_usage FOR SELECT TO {CELLS} USING (true);
        CREATE POLICY ledger_{CELLS} ON ledger FOR SELECT TO {CELLS} USING (true);
        ALTER TABLE allowances ENABLE ROW LEVEL SECURITY;
        ALTER TABLE allowances FORCE ROW LEVEL SECURITY;
        CREATE POLICY allowances_services ON allowances TO CURRENT_USER, {quote(role)}
          USING (true) WITH CHECK (true);
        CREATE POLICY allowances_{CELLS} ON allowances TO {CELLS} USING (true) WITH CHECK (true);
        CREATE POLICY allowances_readers ON allowances FOR SELECT TO {API}, {CONTROL}, {ENGINE} USING (true);
        CREATE POLICY allowances_auditor ON allowances FOR SELECT TO {AUDITOR}
          USING (tenant = current_setting('ballast.tenant', true));
        ALTER TABLE allowances_in_force ENABLE ROW LEVEL SECURITY;
        ALTER TABLE allowances_in_force FORCE ROW LEVEL SECURITY;
        CREATE POLICY allowances_in_force_services ON allowances_in_force TO CURRENT_USER, {quote(role)}
          USING (true) WITH CHECK (true);
        CREATE POLICY allowances_in_force_{CELLS} ON allowances_in_force TO {CELLS} USING (true) WITH CHECK (true);
        CREATE POLICY allowances_in_force_readers ON allowances_in_force FOR SELECT TO {API}, {CONTROL}, {ENGINE}
          USING (true);
        CREATE POLICY allowances_in_force_auditor ON allowances_in_force FOR SELECT TO {AUDITOR}
          USING (tenant = current_setting('ballast.tenant', true));
        """
    )


def downgrade() -> None:
    op.execute(f"DROP POLICY IF EXISTS quota_usage_{CELLS} ON quota_usage")
    op.execute(f"DROP POLICY IF EXISTS ledger_{CELLS} ON ledger")
    op.execute(f"DROP POLICY IF EXISTS engines_{CELLS} ON engines")
    op.execute(f"DROP POLICY IF EXISTS api_keys_{CELLS} ON api_keys")
    op.execute(f"REVOKE ALL ON engines, api_keys, tenants FROM {CELLS}")
    op.execute(f"REVOKE ALL ON quota_usage, quota_fold, ledger, usage_by_day FROM {CELLS}")
    op.drop_table("allowances_in_force")
    op.drop_table("allowances")  # its triggers, policies and grants go with it
    # The role is cluster-wide and other databases may use it: it stays.
    op.execute(f"REVOKE ALL ON SCHEMA public FROM {CELLS}")
