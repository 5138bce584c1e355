#!/bin/bash
# Run once by the postgres image when it first initialises its volume
# (/docker-entrypoint-initdb.d): Temporal's own login and its two databases, so the Temporal
# server never holds the owner's password and cannot read or rewrite the journal. Temporal's
# schema job then finds the databases made and only sets up their schema, as that role.
#
# A volume initialised before this script existed: run it once by hand, as the owner,
#   docker compose exec -e TEMPORAL_DB_PASSWORD postgres bash /docker-entrypoint-initdb.d/10-temporal-role.sh
set -euo pipefail

: "${TEMPORAL_DB_PASSWORD:?set TEMPORAL_DB_PASSWORD}"
TEMPORAL_DB_USER="${TEMPORAL_DB_USER:-temporal}"

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
     -v role="$TEMPORAL_DB_USER" -v pw="$TEMPORAL_DB_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec
ALTER ROLE :"role" PASSWORD :'pw';
SELECT format('CREATE DATABASE %I OWNER %I', d, :'role')
  FROM unnest(ARRAY['temporal', 'temporal_visibility']) AS d
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = d) \gexec
SQL
echo "role $TEMPORAL_DB_USER owns databases temporal and temporal_visibility"
