"""Fencing enforced for every writer, not only well-behaved ones.

- An attempt's events (an item's chunks, preemption marks and result; a fine-tuning
  job's checkpoints) are refused without a fence, so no code path (or raw SQL as the
  service role) can write a result that no current lease speaks for.
- Lease tokens come from a sequence the service role cannot set: a trigger assigns
  every inserted or updated lease the next value, whatever the statement said, so
  tokens only rise and a stale holder cannot be made current again.
- The trigger functions name every table with its schema and run with a fixed
  `search_path` (pg_catalog, then pg_temp last), so a temporary table named `leases`
  cannot stand in for the real one.

Revision ID: 0011
Revises: 0010
"""

from alembic import context, op

from migrations.helpers import service_login

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Frozen here, as every migration's text is: the events an attempt writes under its lease.
_ATTEMPT_EVENTS = "'item_chunk', 'item_preempted', 'item_completed', 'item_failed', 'ft_checkpoint'"
_STALE = "BF001"  # a fence that is not the lease's current token
_UNFENCED = "BF002"  # an attempt's event with no fence at all


def upgrade() -> None:
    role, _ = service_login(context.config)
    quote = op.get_bind().dialect.identifier_preparer.quote
    op.execute(
        f"""
        CREATE SEQUENCE public.lease_tokens AS bigint;
        SELECT setval('public.lease_tokens', coalesce((SELECT max(token) FROM public.leases), 0) + 1, false);
        REVOKE ALL ON SEQUENCE public.lease_tokens FROM PUBLIC;
        REVOKE ALL ON SEQUENCE public.lease_tokens FROM {quote(role)};

        -- SECURITY DEFINER: the service role may not touch the sequence, only the owner's
        -- function draws from it on its behalf.
        CREATE FUNCTION public.leases_next_token() RETURNS trigger LANGUAGE plpgsql
          SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
          IF TG_OP = 'UPDATE' AND NEW.stream IS DISTINCT FROM OLD.stream THEN
            RAISE EXCEPTION 'a lease belongs to its stream: % cannot become %', OLD.stream, NEW.stream
              USING ERRCODE = 'insufficient_privilege';
          END IF;
          NEW.token := nextval('public.lease_tokens');
          RETURN NEW;
        END $$;
        REVOKE ALL ON FUNCTION public.leases_next_token() FROM PUBLIC;
        CREATE TRIGGER leases_next_token BEFORE INSERT OR UPDATE ON public.leases
          FOR EACH ROW EXECUTE FUNCTION public.leases_next_token();

        CREATE OR REPLACE FUNCTION public.events_fenced() RETURNS trigger LANGUAGE plpgsql
          SET search_path = pg_catalog, pg_temp AS $$
        DECLARE
          current bigint;
        BEGIN
          IF NEW.fence IS NULL THEN
            RAISE EXCEPTION 'unfenced % on %: an attempt''s events carry its lease token', NEW.type, NEW.stream
              USING ERRCODE = '{_UNFENCED}';
          END IF;
          SELECT token INTO current FROM public.leases WHERE stream = NEW.stream FOR SHARE;
          IF current IS DISTINCT FROM NEW.fence THEN
            RAISE EXCEPTION 'stale attempt on %: fenced with token % but the lease is at %',
                NEW.stream, NEW.fence, coalesce(current::text, 'none')
              USING ERRCODE = '{_STALE}',
                    DETAIL = json_build_object('stream', NEW.stream, 'fence', NEW.fence, 'current', current)::text;
          END IF;
          RETURN NEW;
        END $$;
        DROP TRIGGER events_fenced ON public.events;
        CREATE TRIGGER events_fenced BEFORE INSERT ON public.events
          FOR EACH ROW WHEN (NEW.fence IS NOT NULL OR NEW.type IN ({_ATTEMPT_EVENTS}))
          EXECUTE FUNCTION public.events_fenced();

        ALTER FUNCTION public.events_append_only() SET search_path = pg_catalog, pg_temp;
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        DROP TRIGGER events_fenced ON public.events;
        CREATE TRIGGER events_fenced BEFORE INSERT ON public.events
          FOR EACH ROW WHEN (NEW.fence IS NOT NULL) EXECUTE FUNCTION public.events_fenced();
        CREATE OR REPLACE FUNCTION public.events_fenced() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
          current bigint;
        BEGIN
          SELECT token INTO current FROM leases WHERE stream = NEW.stream FOR SHARE;
          IF current IS DISTINCT FROM NEW.fence THEN
            RAISE EXCEPTION 'stale attempt on %: fenced with token % but the lease is at %',
                NEW.stream, NEW.fence, coalesce(current::text, 'none')
              USING ERRCODE = '{_STALE}',
                    DETAIL = json_build_object('stream', NEW.stream, 'fence', NEW.fence, 'current', current)::text;
          END IF;
          RETURN NEW;
        END $$;
        ALTER FUNCTION public.events_append_only() RESET search_path;
        DROP TRIGGER leases_next_token ON public.leases;
        DROP FUNCTION public.leases_next_token();
        DROP SEQUENCE public.lease_tokens;
        """
    )
