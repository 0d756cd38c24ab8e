#!/bin/sh
# PostgreSQL's first start: POSTGRES_DB created the Prefect database; MLflow gets its own, owned by
# the same user (POSTGRES_USER, from REPSIM_DB_USER).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres --set owner="$POSTGRES_USER" <<'SQL'
CREATE DATABASE mlflow OWNER :"owner";
SQL
