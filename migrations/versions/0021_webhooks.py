"""Completion webhooks: the endpoints tenants register (`POST /v1/webhooks`), one row each.

Not a projection: the API writes the rows (and soft-deletes them, `deleted_at`), as it
writes tenants and keys; the events raised and every delivery attempt are journal events
(`webhook_event`, `webhook_attempt`, `webhook_abandoned`, stream `webhook:<event id>`).

Each row holds its endpoint's signing secret, which the control worker reads to sign
deliveries. Least privilege:

- `ballast_api` inserts rows and soft-deletes them (UPDATE of `deleted_at` only), and reads
  every column but `secret`: the secret is shown once, in the response that made it, and
  no API process can read one back;
- `ballast_control` reads the rows, secrets included, and nothing more;
- `ballast_engine` has no grant at all.

Row-level security as on every tenant table (0013, 0017): the owner and the services'
old role see every row, each service role as its grant allows.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects.postgresql import ARRAY

from migrations.helpers import SERVICE_ROLES, grant_services, service_login

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

API, CONTROL = SERVICE_ROLES["api"], SERVICE_ROLES["control"]
_READABLE = "id, tenant, url, events, description, created_at, deleted_at"  # all but `secret`
_WRITTEN = "id, tenant, url, secret, events, description, created_at"


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("secret", sa.Text, nullable=False),  # whsec_…: what deliveries are signed with
        sa.Column("events", ARRAY(sa.Text), nullable=False),  # the event types it receives
        sa.Column("description", sa.Text),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("deleted_at", sa.BigInteger),
    )
    op.execute("CREATE INDEX webhooks_tenant_live ON webhooks (tenant, created_at) WHERE deleted_at IS NULL")

    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    grant_services("SELECT, INSERT, UPDATE", "webhooks")
    op.execute(
        f"""
        GRANT SELECT ({_READABLE}), INSERT ({_WRITTEN}), UPDATE (deleted_at) ON webhooks TO {API};
        GRANT SELECT ON webhooks TO {CONTROL};
        ALTER TABLE webhooks ENABLE ROW LEVEL SECURITY;
        ALTER TABLE webhooks FORCE ROW LEVEL SECURITY;
        CREATE POLICY webhooks_services ON webhooks TO CURRENT_USER, {quote(role)} USING (true) WITH CHECK (true);
        CREATE POLICY webhooks_{API} ON webhooks TO {API} USING (true) WITH CHECK (true);
        CREATE POLICY webhooks_{CONTROL} ON webhooks FOR SELECT TO {CONTROL} USING (true);
        """
    )


def downgrade() -> None:
    op.drop_table("webhooks")  # its policies and grants go with it
