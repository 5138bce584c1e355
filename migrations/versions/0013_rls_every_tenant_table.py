"""Row-level security on every table with a tenant column, as 0005 put it on the first
ones: fine-tuning jobs, limits, API keys and the quota fold's tables (0006) too. The
services' role (and the owner running migrations) sees every row; the auditor role reads
only the rows of the tenant its session names (`SET ballast.tenant`) of fine-tuning jobs,
and has no grant on the others.

Revision ID: 0013
Revises: 0012
"""

from alembic import context, op

from migrations.helpers import service_login

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

AUDITOR = "ballast_auditor"
_AUDITED = ("fine_tuning_jobs",)
_TABLES = (*_AUDITED, "limits", "api_keys", "quota_reservations", "quota_open", "quota_open_sums", "quota_buckets")


def upgrade() -> None:
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    for table in _TABLES:
        op.execute(
            f"""
            ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;
            ALTER TABLE {table} FORCE ROW LEVEL SECURITY;
            CREATE POLICY {table}_services ON {table} TO CURRENT_USER, {quote(role)} USING (true) WITH CHECK (true);
            """
        )
    for table in _AUDITED:
        op.execute(
            f"""
            CREATE POLICY {table}_auditor ON {table} FOR SELECT TO {AUDITOR}
              USING (tenant = current_setting('ballast.tenant', true));
            GRANT SELECT ON {table} TO {AUDITOR};
            """
        )


def downgrade() -> None:
    for table in _AUDITED:
        op.execute(f"REVOKE SELECT ON {table} FROM {AUDITOR}; DROP POLICY IF EXISTS {table}_auditor ON {table};")
    for table in _TABLES:
        op.execute(f"DROP POLICY IF EXISTS {table}_services ON {table};"
                   f" ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY; ALTER TABLE {table} DISABLE ROW LEVEL SECURITY;")
