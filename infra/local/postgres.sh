#!/usr/bin/env bash
# A PostgreSQL server of the local stack's own, on 127.0.0.1 only, to rehearse a cluster's storage on one machine:
# the Optuna storage (database "optuna") and MLflow's backend store (database "mlflow"), as infra/mlflow/ runs them.
#   infra/local/postgres.sh start   initialise the cluster if it is new, start it, create both databases; idempotent
#   infra/local/postgres.sh stop    stop it (the data stays for the next start)
# infra/local/start.sh runs it with GRKV_POSTGRES=1, and the tests start their server with it.
# Settings (all optional):
#   GRKV_POSTGRES_DIR       the cluster's folder (default <state>/postgres; as root, /var/tmp/grkv-postgres-<port>:
#                           the server runs as the `postgres` user, which cannot enter root's home)
#   GRKV_POSTGRES_PORT      its port on 127.0.0.1 (default 5433, beside a system server on 5432)
#   GRKV_POSTGRES_PASSWORD  the password of its user `grkv` (default: made once, kept in <dir>/password)
# Writes <state>/postgres.env: GRKV_POSTGRES_URL (the server's SQLAlchemy URL, no database) and the two databases' URLs.
set -euo pipefail

# shellcheck source=infra/local/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

PG_PORT=${GRKV_POSTGRES_PORT:-5433}
is_port "$PG_PORT" || die "GRKV_POSTGRES_PORT='$PG_PORT' is not a valid port number"
PG_USER=grkv
PG_ENV_FILE="$STATE_DIR/postgres.env"
if [[ $(id -u) == 0 ]]; then
  PG_DIR=${GRKV_POSTGRES_DIR:-/var/tmp/grkv-postgres-$PG_PORT}
else
  PG_DIR=${GRKV_POSTGRES_DIR:-$STATE_DIR/postgres}
fi
PG_DATA="$PG_DIR/data"
PG_LOG="$PG_DIR/postgres.log"

# The server's binaries: on PATH, else Debian's versioned folder (the newest).
pg_bin_dir() {
  if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"
    return
  fi
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  [[ -n "$found" && -x "$found/pg_ctl" ]] || die "PostgreSQL's server (initdb, pg_ctl) is not installed; install it (Debian: apt install postgresql)"
  echo "$found"
}
PG_BIN=$(pg_bin_dir)
PSQL=$(command -v psql || echo "$PG_BIN/psql")

# as_server CMD...: run CMD as the server's owner. NOTE: PostgreSQL refuses to run as root; as root the cluster
# belongs to the `postgres` system user.
as_server() {
  if [[ $(id -u) == 0 ]]; then
    id postgres >/dev/null 2>&1 || die "running as root, but there is no 'postgres' user to run the server as"
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

server_running() { as_server "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; }

start_server() {
  mkdir -p "$STATE_DIR"
  if [[ ! -f "$PG_DATA/PG_VERSION" ]]; then
    mkdir -p "$PG_DIR"
    chmod 700 "$PG_DIR"
    if [[ ! -s "$PG_DIR/password" ]]; then
      (umask 077 && printf '%s\n' "${GRKV_POSTGRES_PASSWORD:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}" >"$PG_DIR/password")
    fi
    touch "$PG_LOG"
    if [[ $(id -u) == 0 ]]; then chown -R postgres: "$PG_DIR"; fi
    info "postgres: initialising a cluster in $PG_DATA"
    as_server "$PG_BIN/initdb" -D "$PG_DATA" -U "$PG_USER" --pwfile="$PG_DIR/password" \
      --auth-local=scram-sha-256 --auth-host=scram-sha-256 --encoding=UTF8 --no-instructions >>"$PG_LOG" 2>&1 \
      || die "postgres: initdb failed (log: $PG_LOG)"
  fi
  if server_running; then
    info "postgres: already running ($PG_DATA)"
  else
    # Loopback TCP only: no Unix socket (its default folder may not exist here), fast enough to restart in tests.
    # NOTE: without the caller's descriptors (close_inherited_fds): the server outlives this script.
    (
      close_inherited_fds
      as_server "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 60 \
        -o "-c listen_addresses=$GRKV_HOST -p $PG_PORT -c unix_socket_directories='' -c max_connections=200" start \
        >/dev/null
    ) || die "postgres: did not start on $GRKV_HOST:$PG_PORT (log: $PG_LOG)"
    info "postgres: started on $GRKV_HOST:$PG_PORT (data $PG_DATA, log $PG_LOG)"
  fi
  local password
  password=$(head -n1 "$PG_DIR/password")
  for db in optuna mlflow; do
    if [[ -z $(PGPASSWORD=$password "$PSQL" -h "$GRKV_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = '$db'") ]]; then
      PGPASSWORD=$password "$PSQL" -q -h "$GRKV_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -c "CREATE DATABASE $db" \
        || die "postgres: could not create the database $db"
    fi
  done
  local url="postgresql+psycopg2://$PG_USER:$password@$GRKV_HOST:$PG_PORT"
  (umask 077 && cat >"$PG_ENV_FILE" <<EOF
# written by infra/local/postgres.sh: the local PostgreSQL server's URLs (SQLAlchemy, driver psycopg2)
GRKV_POSTGRES_URL=$url
GRKV_OPTUNA_STORAGE=$url/optuna
GRKV_MLFLOW_BACKEND_STORE_URI=$url/mlflow
GRKV_POSTGRES_DIR=$PG_DIR
EOF
  )
}

stop_server() {
  # NOTE: stop.sh passes none of the start's settings: without them, the cluster is the one the start wrote down.
  if [[ -z "${GRKV_POSTGRES_DIR:-}${GRKV_POSTGRES_PORT:-}" && -f "$PG_ENV_FILE" ]]; then
    PG_DATA="$(sed -n 's/^GRKV_POSTGRES_DIR=//p' "$PG_ENV_FILE")/data"
  fi
  if [[ -f "$PG_DATA/PG_VERSION" ]] && server_running; then
    as_server "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null || die "postgres: did not stop ($PG_DATA)"
    info "postgres: stopped (data kept in $PG_DATA)"
  else
    info "postgres: not running"
  fi
}

case "${1:-}" in
  start) start_server ;;
  stop) stop_server ;;
  *) die "usage: infra/local/postgres.sh start|stop" ;;
esac
