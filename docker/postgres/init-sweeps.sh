#!/bin/sh
# Runs once, when the postgres volume is empty: Optuna's database next to MLflow's ($POSTGRES_DB).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -c "CREATE DATABASE \"${SWEEPS_DB:-sweeps}\" OWNER \"$POSTGRES_USER\""
