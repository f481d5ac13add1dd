#!/usr/bin/env bash
# Start the local GRKV sweep stack, bound to 127.0.0.1 only:
#   * a Ray head node (dashboard + Jobs API, GCS, raylet), and
#   * an MLflow tracking server (SQLite backend, artifacts served from the state dir).
# Waits until both answer (Ray: the Jobs API answers and the dashboard lists an alive node;
# MLflow: GET /health), writes pid/log files in the state dir and prints the URLs and the
# `ray job submit` command. Idempotent: a second run while both answer is a no-op. A service whose
# process runs but does not answer within GRKV_HEALTH_WAIT seconds (e.g. the `ray start --block` leader outliving its
# cluster after `ray stop`), or whose leader died leaving processes behind, is stopped and started again; never a Ray
# head that runs a job (exit 3 instead).
# Stop with infra/local/stop.sh. Settings: see infra/local/common.sh (GRKV_* variables).
set -euo pipefail

# shellcheck source=infra/local/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

require_binaries
take_lock
mkdir -p "$STATE_DIR"
# Keep the state dir out of git and out of `ray job submit --working-dir .` uploads
# (Ray honours nested .gitignore files).
[[ -f "$STATE_DIR/.gitignore" ]] || printf '# written by infra/local/start.sh\n*\n' >"$STATE_DIR/.gitignore"

RAY_PORT=${GRKV_RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${GRKV_RAY_DASHBOARD_PORT:-8265}
RAY_CLIENT_PORT=${GRKV_RAY_CLIENT_PORT:-10001}
RAY_AGENT_PORT=${GRKV_RAY_AGENT_PORT:-52365}
MLFLOW_PORT=${GRKV_MLFLOW_PORT:-5000}
RAY_AUTH=${GRKV_RAY_AUTH_MODE:-disabled}
USE_POSTGRES=${GRKV_POSTGRES:-0}

ray_pid=$(pid_of "$RAY_PID_FILE")
mlflow_pid=$(pid_of "$MLFLOW_PID_FILE")
ray_running=0; mlflow_running=0
alive "$ray_pid" "ray start" && ray_running=1
alive "$mlflow_pid" "mlflow server" && mlflow_running=1

if (( ray_running || mlflow_running )) && [[ -f "$ENDPOINTS_FILE" ]]; then
  # Something already runs from this state dir: keep the ports and auth mode it was started with.
  USE_POSTGRES=0  # what a stack started before the option ran with
  # shellcheck disable=SC1090
  source "$ENDPOINTS_FILE"
  # NOTE: a stack's stores cannot change under it: MLflow's runs and the sweeps' studies would be split across two.
  if [[ -n "${GRKV_POSTGRES:-}" && "$GRKV_POSTGRES" != "${USE_POSTGRES:-0}" ]]; then
    die "the stack in $STATE_DIR runs with GRKV_POSTGRES=${USE_POSTGRES:-0}; stop it first (infra/local/stop.sh) to change that"
  fi
fi

case "$USE_POSTGRES" in
  0|1) ;;
  *) die "GRKV_POSTGRES must be 0 or 1 (got '$USE_POSTGRES')" ;;
esac
for p in RAY_PORT RAY_DASHBOARD_PORT RAY_CLIENT_PORT RAY_AGENT_PORT MLFLOW_PORT; do
  is_port "${!p}" || die "$p='${!p}' is not a valid port number"
done
for p in RAY_CLIENT_PORT RAY_AGENT_PORT RAY_DASHBOARD_PORT RAY_PORT; do
  # Ray's workers take ports 10002-19999 by default; Ray refuses fixed ports in that range.
  if (( ${!p} >= 10002 && ${!p} <= 19999 )); then
    die "$p=${!p} lies in Ray's worker port range 10002-19999; pick another port"
  fi
done
case "$RAY_AUTH" in
  disabled|token) ;;
  *) die "GRKV_RAY_AUTH_MODE must be 'disabled' or 'token' (got '$RAY_AUTH')" ;;
esac

RAY_ADDRESS_GCS="$GRKV_HOST:$RAY_PORT"
RAY_DASHBOARD_URL="http://$GRKV_HOST:$RAY_DASHBOARD_PORT"
MLFLOW_URL="http://$GRKV_HOST:$MLFLOW_PORT"

# MLflow's backend store: SQLite in the state dir, or the stack's PostgreSQL (as a cluster runs it, infra/mlflow/),
# which then holds every sweep's Optuna storage too.
MLFLOW_BACKEND_STORE_URI="sqlite:///$STATE_DIR/mlflow.db"
if (( USE_POSTGRES )); then
  bash "$_common_dir/postgres.sh" start || die "the stack's PostgreSQL did not start (see above)"
  # shellcheck disable=SC1091
  source "$STATE_DIR/postgres.env"
  MLFLOW_BACKEND_STORE_URI=$GRKV_MLFLOW_BACKEND_STORE_URI
  # sweep.py's default Optuna storage (--storage-url), for every job driver the Ray head starts
  export GRKV_OPTUNA_STORAGE
fi

# ---- environment shared by Ray (and every job driver / actor it spawns) and MLflow ----------
export RAY_USAGE_STATS_ENABLED=0
export MLFLOW_DISABLE_TELEMETRY=true
# Ray token auth (Ray >= 2.52) is controlled only by RAY_AUTH_MODE (disabled|token). Left unset,
# `ray start --head` silently switches to token mode when ~/.ray/auth_token (or RAY_AUTH_TOKEN[_PATH])
# exists, and a bare `ray.init()` creates that token -- so set it explicitly, always.
export RAY_AUTH_MODE="$RAY_AUTH"
unset RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH
if [[ "$RAY_AUTH" == token ]]; then
  export RAY_AUTH_TOKEN_PATH="$STATE_DIR/ray_auth_token"
  if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
    (umask 077 && "$PYTHON_BIN" -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH")
    info "generated a Ray auth token in $RAY_AUTH_TOKEN_PATH"
  fi
fi
# On Linux Ray replaces --node-ip-address=127.0.0.1 by the machine's routable IP and binds its
# gRPC servers (GCS, raylet, agents, client server) there. This switch (Ray's single-machine
# mode, meant for macOS/Windows) keeps the node IP and every Ray listener on 127.0.0.1.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Ray gives its dashboard 60 s to start and each dashboard module 30 s, then the head exits; on two busy cores (MLflow
# starting beside it) Ray 2.53's dashboard took longer. A user's own values win.
export RAY_DASHBOARD_STARTUP_TIMEOUT_S=${RAY_DASHBOARD_STARTUP_TIMEOUT_S:-180}
export RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT=${RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT:-120}
# Trials logged from Ray jobs go to this server unless a sweep config says otherwise.
export MLFLOW_TRACKING_URI="$MLFLOW_URL"
# MLflow 3's server also starts a job runner (GenAI judge jobs, huey consumers) by default;
# the sweep service does not use it.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${GRKV_MLFLOW_JOB_EXECUTION:-false}

write_env_files() {
  cat >"$ENDPOINTS_FILE" <<EOF
# written by infra/local/start.sh: what the running stack was started with
RAY_PORT=$RAY_PORT
RAY_DASHBOARD_PORT=$RAY_DASHBOARD_PORT
RAY_CLIENT_PORT=$RAY_CLIENT_PORT
RAY_AGENT_PORT=$RAY_AGENT_PORT
MLFLOW_PORT=$MLFLOW_PORT
RAY_AUTH=$RAY_AUTH
USE_POSTGRES=$USE_POSTGRES
EOF
  {
    echo "# written by infra/local/start.sh -- source it to talk to the local GRKV stack"
    echo "export MLFLOW_TRACKING_URI=$MLFLOW_URL"
    echo "export MLFLOW_DISABLE_TELEMETRY=true"
    echo "export RAY_USAGE_STATS_ENABLED=0"
    echo "export RAY_AUTH_MODE=$RAY_AUTH"
    if [[ "$RAY_AUTH" == token ]]; then echo "export RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"; fi
    echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
    echo "export RAY_API_SERVER_ADDRESS=$RAY_DASHBOARD_URL"
    echo "export GRKV_RAY_ADDRESS=$RAY_ADDRESS_GCS"
    if (( USE_POSTGRES )); then echo "export GRKV_OPTUNA_STORAGE=$GRKV_OPTUNA_STORAGE"; fi
    if [[ -n "$VENV_BIN" ]]; then echo "export PATH=$VENV_BIN:\$PATH"; fi
  } >"$ENV_FILE"
}

stop_cmd="infra/local/stop.sh"
if [[ "$STATE_DIR" != "$DEFAULT_STATE_DIR" ]]; then stop_cmd="GRKV_STATE_DIR=$STATE_DIR $stop_cmd"; fi

print_summary() {
  cat <<EOF
  Ray dashboard / Jobs API : $RAY_DASHBOARD_URL
  Ray GCS address          : $RAY_ADDRESS_GCS
  MLflow tracking server   : $MLFLOW_URL   (exported to Ray jobs as MLFLOW_TRACKING_URI)
  Ray auth mode            : $RAY_AUTH (RAY_AUTH_MODE)
  State dir                : $STATE_DIR  (ray.pid ray.log mlflow.pid mlflow.log mlflow.db mlartifacts/)
$( (( USE_POSTGRES )) && echo "  PostgreSQL               : $GRKV_HOST:${GRKV_POSTGRES_PORT:-5433}: MLflow's backend store and the sweeps' Optuna storage (\$GRKV_OPTUNA_STORAGE), data in $GRKV_POSTGRES_DIR")
Client environment: source $ENV_FILE
Submit the smoke sweep from the repo root ($REPO_ROOT):
  ray job submit --address $RAY_DASHBOARD_URL --working-dir . -- python sweep.py --config sweeps/configs/smoke.yaml
Stop everything: $stop_cmd
EOF
}

# ---- helpers ----------------------------------------------------------------------------------
port_free() {
  "$PYTHON_BIN" - "$1" <<'PY'
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: ignore TIME_WAIT
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
PY
}

# http_get URL [HEADER] [SECONDS]: print the body of GET URL if it answers 2xx within SECONDS (default 3), else fail.
# The header goes through stdin, not argv, so a token never shows in `ps`.
http_get() {
  local url=$1 header=${2:-X-Grkv: 1} seconds=${3:-3}
  if command -v curl >/dev/null 2>&1; then
    printf '%s\n' "$header" | curl -fsS --max-time "$seconds" -H @- "$url" 2>/dev/null
  else
    printf '%s\n' "$header" | "$PYTHON_BIN" -c 'import sys, urllib.request as u
k, v = sys.stdin.readline().strip().split(": ", 1)
sys.stdout.write(u.urlopen(u.Request(sys.argv[1], headers={k: v}), timeout=float(sys.argv[2])).read().decode())' \
      "$url" "$seconds" 2>/dev/null
  fi
}
http_ok() { http_get "$@" >/dev/null; }

# In token mode the dashboard / Jobs API wants the token too (only /api/*healthz are public).
ray_http_header="X-Grkv: 1"
if [[ "$RAY_AUTH" == token ]]; then
  ray_http_header="Authorization: Bearer $(tr -d '[:space:]' <"$RAY_AUTH_TOKEN_PATH")"
fi

# ray_answers: the Jobs API answers and the dashboard lists an alive node. Both are HTTP calls the dashboard serves
# from the GCS in well under a second, also on a loaded machine (where `ray status` took 31 s at load 6 on 2 cores).
ray_answers() {
  http_ok "$RAY_DASHBOARD_URL/api/jobs/" "$ray_http_header" 10 || return 1
  [[ "$(http_get "$RAY_DASHBOARD_URL/api/v0/nodes" "$ray_http_header" 10)" == *'"ALIVE"'* ]]
}
# ray_runs_jobs: a Ray head whose raylet has a job's supervisor actor among its workers runs a job (asked of the
# processes, so it holds for a head that does not answer; the workers have process groups of their own).
ray_runs_jobs() {
  local raylets
  raylets=$(ps -ww -o pid=,args= -g "$ray_pid" 2>/dev/null | awk '$2 ~ /raylet\/raylet$/ {print $1}' | paste -sd, -)
  [[ -n "$raylets" ]] && ps -ww -o args= --ppid "$raylets" 2>/dev/null | grep -q '^ray::JobSupervisor'
}
# A head that runs is given this long to answer before it counts as not answering (a loaded machine is slow, not dead).
health_wait_s=${GRKV_HEALTH_WAIT:-60}
ray_answers_within() {
  local t0=$SECONDS
  until ray_answers; do
    # NOTE: nothing listening on the dashboard's port is a head gone (`ray stop`), not a slow one: no wait.
    listening "$RAY_DASHBOARD_PORT" || return 1
    (( SECONDS - t0 >= health_wait_s )) && return 1
    sleep 2
  done
}
listening() { (exec 3<>"/dev/tcp/$GRKV_HOST/$1") 2>/dev/null; }
mlflow_answers() { http_ok "$MLFLOW_URL/health"; }

# A process is not a service: what runs but does not answer, or what a dead leader left behind in its
# process group, is stopped here and started again below.
failed=0
stopped=0
if (( ray_running )) && ! ray_answers_within; then
  # NOTE: never restart a head that runs a job: that would kill the job (and its sweep's running trials).
  if ray_runs_jobs; then
    echo "grkv-local: error: Ray head (pid $ray_pid) runs a job but does not answer $RAY_DASHBOARD_URL (waited ${health_wait_s}s); left running (stop it: $stop_cmd)" >&2
    exit 3
  fi
  info "Ray head (pid $ray_pid) runs no job and does not answer $RAY_DASHBOARD_URL; restarting it"
  ray_running=0
fi
if (( mlflow_running )) && ! mlflow_answers; then
  info "MLflow (pid $mlflow_pid) runs but does not answer $MLFLOW_URL/health; restarting it"
  mlflow_running=0
fi
if (( ! ray_running )) && [[ -f "$RAY_PID_FILE" ]]; then stop_service ray "$RAY_PID_FILE" "ray start"; fi
if (( ! mlflow_running )) && [[ -f "$MLFLOW_PID_FILE" ]]; then stop_service mlflow "$MLFLOW_PID_FILE" "mlflow server"; fi
(( failed )) && die "could not stop what was left of the previous services (see above)"

if (( ray_running && mlflow_running )); then
  info "already running and answering (ray pid $ray_pid, mlflow pid $mlflow_pid); nothing to do."
  print_summary
  exit 0
fi


# launch PIDFILE LOG CMD...: run CMD in its own session/process group (pgid == pid) so stop.sh
# can stop exactly that tree; stdin from /dev/null, output to LOG, no other descriptor inherited (close_inherited_fds).
launch() {
  local pidfile=$1 log=$2
  shift 2
  (
    close_inherited_fds
    exec "$PYTHON_BIN" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@" </dev/null >>"$log" 2>&1
  ) &
  echo $! >"$pidfile"
}

# still_running PIDFILE: the service this run just launched has not exited. NOTE: no command-line
# check here (unlike `alive`, which guards pid files left by an earlier run against pid reuse):
# until the forked subshell has exec'd the service, /proc/PID/cmdline still reads
# "bash start.sh", and on a loaded machine the first poll sees exactly that.
still_running() {
  local pid
  pid=$(pid_of "$1")
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

started=()
abort() {
  echo "grkv-local: error: $1" >&2
  if [[ -n "${2:-}" && -f "$2" ]]; then
    echo "---- last lines of $2 ----" >&2
    tail -n 25 "$2" >&2 || true
    echo "----" >&2
  fi
  local svc pidfile pid
  for svc in "${started[@]}"; do
    pidfile="$STATE_DIR/$svc.pid"
    pid=$(pid_of "$pidfile")
    if [[ -n "$pid" ]]; then
      echo "grkv-local: stopping $svc (pid $pid) started by this run" >&2
      kill -TERM -- "-$pid" 2>/dev/null || true
      for _ in $(seq 20); do [[ -z "$(group_pids "$pid")" ]] && break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  exit 1
}
trap 'abort "interrupted"' INT TERM

# ---- start what is not running -------------------------------------------------------------
cd "$REPO_ROOT"   # the Ray head's cwd (job drivers without --working-dir run from here)

if (( ! mlflow_running )); then
  rm -f "$MLFLOW_PID_FILE"
  port_free "$MLFLOW_PORT" || die "port $MLFLOW_PORT (MLflow) on $GRKV_HOST is already in use; set GRKV_MLFLOW_PORT"
fi
if (( ! ray_running )); then
  rm -f "$RAY_PID_FILE"
  for p in RAY_PORT RAY_DASHBOARD_PORT RAY_CLIENT_PORT RAY_AGENT_PORT; do
    port_free "${!p}" || die "port ${!p} ($p) on $GRKV_HOST is already in use; set GRKV_$p (stop another Ray with its own stop command)"
  done
  RAY_TEMP_DIR=${GRKV_RAY_TEMP_DIR:-$STATE_DIR/ray}
  # Ray puts Unix sockets under <temp-dir>/session_<timestamp>_<pid>/sockets/; the Linux limit on
  # a socket path is 107 bytes, which leaves ~36 characters for the temp dir itself.
  if (( ${#RAY_TEMP_DIR} > 36 )); then
    [[ -n "${GRKV_RAY_TEMP_DIR:-}" ]] && die "GRKV_RAY_TEMP_DIR='$RAY_TEMP_DIR' is too long for Ray's Unix sockets (max 36 characters)"
    RAY_TEMP_DIR="/tmp/grkv-ray-$(id -u)-$RAY_PORT"
    info "state dir path too long for Ray's Unix sockets; Ray temp dir (session logs): $RAY_TEMP_DIR"
  fi
  mkdir -p "$RAY_TEMP_DIR"
  echo "$RAY_TEMP_DIR" >"$STATE_DIR/ray.tempdir"
fi

write_env_files

if (( ! mlflow_running )); then
  mkdir -p "$STATE_DIR/mlartifacts"
  echo "=== $(date -u +%FT%TZ) infra/local/start.sh ===" >>"$MLFLOW_LOG"
  launch "$MLFLOW_PID_FILE" "$MLFLOW_LOG" "$MLFLOW_BIN" server \
    --host "$GRKV_HOST" --port "$MLFLOW_PORT" \
    --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" \
    --artifacts-destination "$STATE_DIR/mlartifacts" \
    --workers "${GRKV_MLFLOW_WORKERS:-1}"
  started+=(mlflow)
  info "starting MLflow tracking server on $MLFLOW_URL (pid $(pid_of "$MLFLOW_PID_FILE"), log $MLFLOW_LOG)"
else
  info "MLflow already running (pid $mlflow_pid)"
fi

if (( ! ray_running )); then
  ray_args=(start --head --block
    --node-ip-address="$GRKV_HOST" --port="$RAY_PORT"
    --dashboard-host="$GRKV_HOST" --dashboard-port="$RAY_DASHBOARD_PORT" --include-dashboard=true
    --ray-client-server-port="$RAY_CLIENT_PORT" --dashboard-agent-listen-port="$RAY_AGENT_PORT"
    --num-cpus="${GRKV_RAY_CPUS:-2}" --temp-dir="$RAY_TEMP_DIR" --disable-usage-stats)
  if [[ -n "${GRKV_RAY_GPUS:-}" ]]; then ray_args+=(--num-gpus="$GRKV_RAY_GPUS"); fi
  echo "=== $(date -u +%FT%TZ) infra/local/start.sh ===" >>"$RAY_LOG"
  # --block keeps `ray start` in the foreground of its process group: SIGTERM to it drains the
  # node and stops every Ray process it started (that is what stop.sh does; never `ray stop`,
  # which kills every Ray process of this user on the machine).
  launch "$RAY_PID_FILE" "$RAY_LOG" "$RAY_BIN" "${ray_args[@]}"
  started+=(ray)
  info "starting Ray head on $RAY_ADDRESS_GCS, dashboard $RAY_DASHBOARD_URL (pid $(pid_of "$RAY_PID_FILE"), log $RAY_LOG)"
else
  info "Ray head already running (pid $ray_pid)"
fi

# ---- wait until both answer ----------------------------------------------------------------
timeout_s=${GRKV_START_TIMEOUT:-180}
t0=$SECONDS
ray_ready=$ray_running
mlflow_ready=$mlflow_running
while :; do
  if (( ! mlflow_ready )); then
    still_running "$MLFLOW_PID_FILE" || abort "MLflow server exited during startup" "$MLFLOW_LOG"
    if mlflow_answers; then
      mlflow_ready=1
      info "MLflow answers $MLFLOW_URL/health (after $((SECONDS - t0)) s)"
    fi
  fi
  if (( ! ray_ready )); then
    still_running "$RAY_PID_FILE" || abort "Ray head exited during startup" "$RAY_LOG"
    if ray_answers; then
      ray_ready=1
      info "Ray answers $RAY_DASHBOARD_URL with an alive node (after $((SECONDS - t0)) s)"
    fi
  fi
  (( ray_ready && mlflow_ready )) && break
  if (( SECONDS - t0 >= timeout_s )); then
    if (( ! mlflow_ready )); then abort "MLflow did not answer within ${timeout_s}s" "$MLFLOW_LOG"; fi
    abort "Ray did not answer within ${timeout_s}s" "$RAY_LOG"
  fi
  sleep 1
done
trap - INT TERM

info "GRKV local stack is up."
print_summary
