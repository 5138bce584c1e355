"""Reserved capacity: `reservations`, a tenant's sequence slots on a model's pool.

A projection of `reservation_set` events (stream `reservation:<tenant>:<model>`): the
journal holds every grant and change, who made it and when; the row is the one in force
(`slots` 0: none, and the row goes). An admin sets them (`PUT /admin/tenants/{id}/
reservations`); each engine worker of the pool reads its pool's and keeps its share of
each reservation's slots from every other tenant's interactive work (engine/fair_share.py).

Least privilege: the API projects the rows (insert, update, delete); the control worker
and the engine workers read them; the auditor reads its tenant's (row-level security, as
on every tenant table).

Revision ID: 0029
Revises: 0028
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import SERVICE_ROLES, grant_services, service_login

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

API, CONTROL, ENGINE = (SERVICE_ROLES[k] for k in ("api", "control", "engine"))
AUDITOR = "ballast_auditor"  # 0005


def upgrade() -> None:
    op.create_table(
        "reservations",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("set_at", sa.BigInteger, nullable=False),  # unix seconds, as its event says
        sa.Column("position", sa.BigInteger, nullable=False),  # its event's
    )
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    grant_services("SELECT, INSERT, UPDATE, DELETE", "reservations")
    op.execute(
        f"""
        GRANT SELECT, INSERT, UPDATE, DELETE ON reservations TO {API};
        GRANT SELECT ON reservations TO {CONTROL}, {ENGINE}, {AUDITOR};
        ALTER TABLE reservations ENABLE ROW LEVEL SECURITY;
        ALTER TABLE reservations FORCE ROW LEVEL SECURITY;
        CREATE POLICY reservations_services ON reservations TO CURRENT_USER, {quote(role)}
          USING (true) WITH CHECK (true);
        CREATE POLICY reservations_{API} ON reservations TO {API} USING (true) WITH CHECK (true);
        CREATE POLICY reservations_readers ON reservations FOR SELECT TO {CONTROL}, {ENGINE} USING (true);
        CREATE POLICY reservations_auditor ON reservations FOR SELECT TO {AUDITOR}
          USING (tenant = current_setting('ballast.tenant', true));
        """
    )


def downgrade() -> None:
    op.drop_table("reservations")  # its policies and grants go with it
