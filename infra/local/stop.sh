#!/usr/bin/env bash
# Stop the local GRKV sweep stack started by infra/local/start.sh (same GRKV_STATE_DIR).
# Only the process groups recorded in the state dir's pid files are signalled: SIGTERM first
# (Ray drains its node and stops its processes; MLflow forwards it to its uvicorn workers),
# SIGKILL for whatever is left after GRKV_STOP_TIMEOUT seconds. Deliberately not `ray stop`,
# which would kill every Ray process of this user on the machine, other clusters included.
# Running it when nothing runs is fine (exit 0). Data (mlflow.db, mlartifacts/, logs) is kept.
set -euo pipefail

# shellcheck source=infra/local/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

if [[ ! -d "$STATE_DIR" ]]; then
  info "no state dir $STATE_DIR; nothing to stop."
  exit 0
fi
take_lock

failed=0
stopped=0

stop_service ray "$RAY_PID_FILE" "ray start"
stop_service mlflow "$MLFLOW_PID_FILE" "mlflow server"
# The stack's own PostgreSQL (GRKV_POSTGRES=1 at the start), after MLflow, its client.
if [[ -f "$ENDPOINTS_FILE" ]] && grep -qx "USE_POSTGRES=1" "$ENDPOINTS_FILE"; then
  bash "$_common_dir/postgres.sh" stop || failed=1
fi

if (( failed )); then
  exit 1
fi
if (( stopped )); then
  info "local stack stopped (state kept in $STATE_DIR)."
else
  info "nothing was running (state dir $STATE_DIR)."
fi
