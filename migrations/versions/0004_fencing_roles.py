"""Fenced attempts (leases, events.fence) and the services' restricted role.

Each attempt at a batch item takes the item stream's lease and fences its appends with
the token: the database refuses an append whose fence is not the stream's current token,
so a zombie attempt cannot write after its retry has started.

Migrations run as the owner; the API and workers connect as the service role (default
`ballast_service`), which may SELECT and INSERT on `events` and nothing else there: no
UPDATE, DELETE, TRUNCATE, no trigger or schema change (those need the owner). It owns
nothing. New tables are readable by it by default (ALTER DEFAULT PRIVILEGES below);
every later migration that adds a table the services write grants that explicitly with
`migrations.helpers.grant_services("SELECT, INSERT", "t")`; tests connect as this role, so
a missing grant fails them.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import context, op

from migrations.helpers import grant_services, service_login

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# A class of our own, so callers tell a stale attempt from any other error.
STALE_SQLSTATE = "BF001"


def _login_into_settings() -> None:
    # DO blocks take no parameters: hand the role and password over as transaction-local
    # settings, bound as values, so neither is ever spliced into SQL text.
    role, password = service_login(context.config)
    op.get_bind().execute(
        sa.text("SELECT set_config('ballast.service_role', :r, true),"
                " set_config('ballast.service_password', :p, true)"),
        dict(r=role, p=password or ""),
    )


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("stream", sa.Text, primary_key=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.add_column("events", sa.Column("fence", sa.BigInteger, nullable=True))
    # FOR SHARE: an append waits for an acquire in flight and then sees its token; an
    # acquire waits for appends in flight, so every accepted fenced event commits before
    # the next token exists. WHEN: unfenced appends (most) never call the function.
    op.execute(
        f"""
        CREATE FUNCTION events_fenced() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
          current bigint;
        BEGIN
          SELECT token INTO current FROM leases WHERE stream = NEW.stream FOR SHARE;
          IF current IS DISTINCT FROM NEW.fence THEN
            RAISE EXCEPTION 'stale attempt on %: fenced with token % but the lease is at %',
                NEW.stream, NEW.fence, coalesce(current::text, 'none')
              USING ERRCODE = '{STALE_SQLSTATE}',
                    DETAIL = json_build_object('stream', NEW.stream, 'fence', NEW.fence, 'current', current)::text;
          END IF;
          RETURN NEW;
        END $$;
        CREATE TRIGGER events_fenced BEFORE INSERT ON events
          FOR EACH ROW WHEN (NEW.fence IS NOT NULL) EXECUTE FUNCTION events_fenced();
        """
    )

    _login_into_settings()
    op.execute(
        """
        DO $$
        DECLARE
          r text := current_setting('ballast.service_role');
          pw text := nullif(current_setting('ballast.service_password'), '');
        BEGIN
          BEGIN
            EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS', r);
          EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- roles are cluster-wide: another database's migration (maybe right now) made it
          END;
          IF EXISTS (SELECT FROM pg_roles WHERE rolname = r AND (rolsuper OR rolcreatedb OR rolcreaterole
                     OR rolreplication OR rolbypassrls OR NOT rolcanlogin)) THEN
            EXECUTE format('ALTER ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS', r);
          END IF;
          -- Owning a table, or being the owner's member, would give back all that is withheld.
          IF pg_has_role(r, current_user, 'MEMBER')
             OR EXISTS (SELECT FROM pg_class WHERE relowner = (SELECT oid FROM pg_roles WHERE rolname = r)) THEN
            RAISE EXCEPTION 'the service role % must not own tables here nor be (a member of) the owner %',
              r, current_user;
          END IF;
          IF pw IS NOT NULL THEN
            EXECUTE format('ALTER ROLE %I PASSWORD %L', r, pw);
          END IF;

          EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), r);
          EXECUTE format('GRANT USAGE ON SCHEMA public TO %I', r);
          EXECUTE format('REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON events FROM %I', r);
          EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO %I', r);
          EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO %I', r);
          EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE ON SEQUENCES TO %I', r);
        END $$;
        """
    )
    grant_services("SELECT, INSERT", "events")
    # Read models are projected in the appending transaction; attempts take leases;
    # engines announce (upsert) and withdraw (delete) themselves.
    grant_services("SELECT, INSERT, UPDATE", "files", "batches", "batch_items", "leases")
    grant_services("SELECT, INSERT, UPDATE, DELETE", "engines")


def downgrade() -> None:
    # The role stays: it is cluster-wide, and other databases may use it.
    _login_into_settings()
    op.execute(
        """
        DO $$
        DECLARE
          r text := current_setting('ballast.service_role');
        BEGIN
          IF EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM %I', r);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE USAGE ON SEQUENCES FROM %I', r);
            EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM %I', r);
            EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA public FROM %I', r);
            EXECUTE format('REVOKE USAGE ON SCHEMA public FROM %I', r);
            EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM %I', current_database(), r);
          END IF;
        END $$;
        """
    )
    op.execute("DROP TRIGGER events_fenced ON events")
    op.execute("DROP FUNCTION events_fenced()")
    op.drop_column("events", "fence")
    op.drop_table("leases")
