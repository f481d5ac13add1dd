#!/bin/sh
# PostgreSQL init script (docker-entrypoint-initdb.d; runs once, on an empty data directory).
# The image creates POSTGRES_DB (mlflow: MLflow's backend store); add the Optuna storage database.
# Mounted by docker-compose.yaml; the same script is inlined in postgres.yaml's ConfigMap.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<EOSQL
CREATE DATABASE optuna OWNER "$POSTGRES_USER";
EOSQL
