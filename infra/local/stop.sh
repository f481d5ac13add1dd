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

stop_timeout=${GRKV_STOP_TIMEOUT:-40}
failed=0
stopped=0

# stop_service NAME PIDFILE WORD
stop_service() {
  local name=$1 pidfile=$2 word=$3 pid left waited
  pid=$(pid_of "$pidfile")
  if [[ -z "$pid" ]]; then
    info "$name: not running (no pid file)."
    rm -f "$pidfile"
    return 0
  fi
  if ! alive "$pid" "$word" && [[ -z "$(group_pids "$pid")" ]]; then
    info "$name: not running (removed stale pid file, pid $pid)."
    rm -f "$pidfile"
    return 0
  fi
  info "$name: stopping process group $pid ..."
  # The leader first: it shuts its children down in order.
  kill -TERM "$pid" 2>/dev/null || true
  waited=0
  while alive "$pid" "$word" && (( waited < stop_timeout * 2 )); do
    sleep 0.5; waited=$((waited + 1))
  done
  # Then anything left in the group (workers, agents, uvicorn children).
  left=$(group_pids "$pid")
  if [[ -n "$left" ]]; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 10); do
      [[ -z "$(group_pids "$pid")" ]] && break
      sleep 0.5
    done
  fi
  left=$(group_pids "$pid")
  if [[ -n "$left" ]]; then
    info "$name: forcing the rest of group $pid: $(echo "$left" | tr '\n' ' ')"
    kill -KILL -- "-$pid" 2>/dev/null || true
    sleep 1
  fi
  if [[ -n "$(group_pids "$pid")" ]] || alive "$pid" "$word"; then
    echo "grkv-local: error: $name: processes of group $pid survived SIGKILL" >&2
    failed=1
    return 0
  fi
  rm -f "$pidfile"
  stopped=$((stopped + 1))
  info "$name: stopped."
}

stop_service ray "$RAY_PID_FILE" "ray start"
stop_service mlflow "$MLFLOW_PID_FILE" "mlflow server"

if (( failed )); then
  exit 1
fi
if (( stopped )); then
  info "local stack stopped (state kept in $STATE_DIR)."
else
  info "nothing was running (state dir $STATE_DIR)."
fi
