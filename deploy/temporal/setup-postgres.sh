#!/bin/sh
# Sets up (or upgrades) the schema of Temporal's two databases in the shared Postgres: run
# by the `temporal-schema` service before the server starts, as Temporal's own role, which
# owns the databases (deploy/postgres/10-temporal-role.sh made both at initdb; `create` here
# covers a server where the role may create databases). Every step is idempotent, so it is
# safe on every `docker compose up` and after a Temporal upgrade.
set -eu

: "${POSTGRES_SEEDS:?}" "${POSTGRES_USER:?}" "${SQL_PASSWORD:?}"
DB_PORT="${DB_PORT:-5432}"
DBNAME="${DBNAME:-temporal}"
VISIBILITY_DBNAME="${VISIBILITY_DBNAME:-temporal_visibility}"
SCHEMA_ROOT=/etc/temporal/schema/postgresql/v12

until nc -z "${POSTGRES_SEEDS%%,*}" "$DB_PORT"; do
  echo "waiting for postgres at ${POSTGRES_SEEDS%%,*}:$DB_PORT"
  sleep 1
done

sql() {
  temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "$DB_PORT" -u "$POSTGRES_USER" "$@"
}

# `create` fails when the database already exists; that is the normal case on a re-run.
sql --db "$DBNAME" create || echo "database $DBNAME exists"
sql --db "$DBNAME" setup-schema -v 0.0
sql --db "$DBNAME" update-schema -d "$SCHEMA_ROOT/temporal/versioned"

sql --db "$VISIBILITY_DBNAME" create || echo "database $VISIBILITY_DBNAME exists"
sql --db "$VISIBILITY_DBNAME" setup-schema -v 0.0
sql --db "$VISIBILITY_DBNAME" update-schema -d "$SCHEMA_ROOT/visibility/versioned"

echo "temporal schema ready in $DBNAME and $VISIBILITY_DBNAME"
