"""A database role per service: the API, the control worker and engine workers each log
in as their own role, granted only what that service does.

`ballast_service` (0004) may do what all three do; a host that holds its password holds
everything: an engine host could mint keys, lift limits or announce another engine's URL.
Now:

- `ballast_api` reads what the API serves and writes what a request or an admin writes:
  files, batches and fine-tuning jobs as created or cancelled, tenants, keys, limits and
  tiers, admission's holders and reservations.
- `ballast_control` runs batches, fine-tuning jobs' bookkeeping, the fleet controller and
  the quota fold: items, statuses, output files, expiry, engines' batch caps. It never
  writes tenants, keys or limits, and reads no key.
- `ballast_engine` journals what it generated and trained and announces itself. It may
  append only its own kinds of event (chunks, results, checkpoints, what it served),
  touch only the `engines` rows its login made (the `login` column, filled by the
  database), and change only their announcement (not `batch_cap`, not `draining`). It
  never writes tenants, keys, limits, files, batches or jobs, and reads no key.

An operator who gives each engine host a login of its own (`CREATE ROLE host7 LOGIN
PASSWORD '…' IN ROLE ballast_engine`) gets the same rights per host, and a host can then
touch no other host's row.

The roles are created without a password: `ballast migrate` and `ballast up` set each one
they are given (BALLAST_{API,CONTROL,ENGINE}_DATABASE_PASSWORD). `ballast_service` keeps
what it had, for a deployment not yet moved over and for tests that run every service in
one process; no shipped deployment hands it out any more.

Revision ID: 0017
Revises: 0016
"""

from alembic import op

from migrations.helpers import SERVICE_ROLES, grant_role

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

API, CONTROL, ENGINE = (SERVICE_ROLES[k] for k in ("api", "control", "engine"))
ROLES = (API, CONTROL, ENGINE)
OLD_SERVICE = "ballast_service"

_QUOTA = ("quota_usage", "quota_reservations", "quota_open", "quota_open_sums", "quota_buckets", "quota_fold")
_VIEWS = ("usage_by_minute", "usage_by_hour", "usage_by_day", "open_reservations", "reserved_vs_settled")
S, SI, SIU, SIUD = "SELECT", "SELECT, INSERT", "SELECT, INSERT, UPDATE", "SELECT, INSERT, UPDATE, DELETE"

# Table privileges by service; `engines` is below (columns and rows).
GRANTS: dict[str, dict[str, str]] = {
    "api": dict(events=SI, files=SIUD, batches=SIU, batch_items=S, fine_tuning_jobs=SIU,
                tenants=SIU, api_keys=SIU, limits=SIU, ledger=SI, admission_holders=SIUD,
                **{t: S for t in (*_QUOTA, *_VIEWS)}),
    "control": dict(events=SI, files=SIUD, batches="SELECT, UPDATE", batch_items=SIU,
                    fine_tuning_jobs="SELECT, UPDATE", leases=SIU, tenants=S, limits=S, ledger=SI,
                    admission_holders="SELECT, DELETE", **{t: SIUD for t in _QUOTA}, **{t: S for t in _VIEWS}),
    "engine": dict(events=SI, files=S, batches=S, batch_items="SELECT, UPDATE", fine_tuning_jobs=S, leases=SIU,
                   tenants=S, limits=S, ledger=SI, **{t: S for t in _QUOTA}),
}
_ANNOUNCED = "id, url, model, queue, stats, seen_at"
ENGINE_EVENTS = ("item_chunk", "item_preempted", "item_completed", "item_failed", "ft_checkpoint", "ft_event",
                 "request_served")


def _rls_tables() -> list[str]:
    rows = op.get_bind().exec_driver_sql(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relrowsecurity ORDER BY 1")
    return [r[0] for r in rows]


def upgrade() -> None:
    for role in ROLES:
        op.execute(
            f"""
            DO $$
            BEGIN
              BEGIN
                CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
              EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- roles are cluster-wide: another database's migration made it
              END;
              -- Only where it differs: an ALTER ROLE rewrites the cluster-wide row, and another
              -- database's migration doing the same at once fails ("tuple concurrently updated").
              IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}' AND (rolsuper OR rolcreatedb OR rolcreaterole
                         OR rolreplication OR rolbypassrls)) THEN
                ALTER ROLE {role} NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
              END IF;
              -- Owning a table, or being the owner's member, would give back all that is withheld.
              IF pg_has_role('{role}', current_user, 'MEMBER')
                 OR EXISTS (SELECT FROM pg_class WHERE relowner = '{role}'::regrole) THEN
                RAISE EXCEPTION 'the service role {role} must not own tables here nor be (a member of) the owner %',
                  current_user;
              END IF;
              EXECUTE format('GRANT CONNECT ON DATABASE %I TO {role}', current_database());
            END $$;
            GRANT USAGE ON SCHEMA public TO {role};
            GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role};
            """
        )
    for service, grants in GRANTS.items():
        for table, privileges in grants.items():
            grant_role(service, privileges, table)
    op.execute(
        f"""
        GRANT SELECT ON engines TO {API}, {CONTROL}, {ENGINE};
        GRANT UPDATE (batch_cap) ON engines TO {CONTROL};
        GRANT INSERT ({_ANNOUNCED}), UPDATE ({_ANNOUNCED}), DELETE ON engines TO {ENGINE};
        """
    )

    # Rows: every role sees every row of the tenant tables (the API checks the tenant);
    # the engine role appends only its own kinds of event.
    for table in _rls_tables():
        for role in ROLES:
            if table == "events" and role == ENGINE:
                continue
            op.execute(f"CREATE POLICY {table}_{role} ON {table} TO {role} USING (true) WITH CHECK (true)")
    kinds = ", ".join(f"'{k}'" for k in ENGINE_EVENTS)
    op.execute(
        f"""
        CREATE POLICY events_{ENGINE}_reads ON events FOR SELECT TO {ENGINE} USING (true);
        CREATE POLICY events_{ENGINE}_appends ON events FOR INSERT TO {ENGINE} WITH CHECK (type IN ({kinds}));
        """
    )

    # engines: who announced each row, as the database saw it; an engine login touches
    # only its own. The owner (`ballast worker drain`) and the old role see every row.
    op.execute(
        f"""
        ALTER TABLE engines ADD COLUMN login text NOT NULL DEFAULT current_user;
        ALTER TABLE engines ENABLE ROW LEVEL SECURITY;
        ALTER TABLE engines FORCE ROW LEVEL SECURITY;
        CREATE POLICY engines_owner ON engines TO CURRENT_USER USING (true) WITH CHECK (true);
        DO $$
        BEGIN
          IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{OLD_SERVICE}') THEN
            CREATE POLICY engines_{OLD_SERVICE} ON engines TO {OLD_SERVICE} USING (true) WITH CHECK (true);
          END IF;
        END $$;
        CREATE POLICY engines_{API} ON engines FOR SELECT TO {API} USING (true);
        CREATE POLICY engines_{CONTROL}_reads ON engines FOR SELECT TO {CONTROL} USING (true);
        CREATE POLICY engines_{CONTROL}_caps ON engines FOR UPDATE TO {CONTROL} USING (true) WITH CHECK (true);
        CREATE POLICY engines_{ENGINE} ON engines TO {ENGINE}
          USING (login = current_user) WITH CHECK (login = current_user);
        """
    )


def downgrade() -> None:
    for name in ("owner", OLD_SERVICE, API, f"{CONTROL}_reads", f"{CONTROL}_caps", ENGINE):
        op.execute(f"DROP POLICY IF EXISTS engines_{name} ON engines")
    op.execute("ALTER TABLE engines NO FORCE ROW LEVEL SECURITY; ALTER TABLE engines DISABLE ROW LEVEL SECURITY;"
               " ALTER TABLE engines DROP COLUMN login")
    op.execute(f"DROP POLICY events_{ENGINE}_reads ON events; DROP POLICY events_{ENGINE}_appends ON events")
    for table in _rls_tables():
        for role in ROLES:
            op.execute(f"DROP POLICY IF EXISTS {table}_{role} ON {table}")
    # The roles stay: they are cluster-wide, and other databases may use them.
    for role in ROLES:
        op.execute(
            f"""
            REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role};
            REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {role};
            REVOKE USAGE ON SCHEMA public FROM {role};
            DO $$ BEGIN EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {role}', current_database()); END $$;
            """
        )
