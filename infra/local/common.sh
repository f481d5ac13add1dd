# shellcheck shell=bash disable=SC2034  # variables are used by the scripts that source this file
# Shared settings and helpers for infra/local/start.sh and infra/local/stop.sh.
# Sourced, never run directly. Everything binds to 127.0.0.1 only.
#
# Environment overrides (all optional):
#   GRKV_STATE_DIR            state dir: pid files, logs, MLflow DB + artifacts, Ray temp dir
#                             (default: ~/.grkv/local, the folder `grkv sweep` uses: sweeps/entry_points.py)
#   GRKV_RAY_PORT             Ray GCS port                      (default 6379)
#   GRKV_RAY_DASHBOARD_PORT   Ray dashboard / Jobs API port     (default 8265)
#   GRKV_RAY_CLIENT_PORT      Ray client server port            (default 10001)
#   GRKV_RAY_AGENT_PORT       Ray dashboard agent HTTP port     (default 52365)
#   GRKV_RAY_CPUS             CPUs the Ray head advertises      (default 2)
#   GRKV_RAY_GPUS             GPUs the Ray head advertises      (default: Ray autodetects)
#   GRKV_RAY_AUTH_MODE        disabled | token                  (default disabled; exported as RAY_AUTH_MODE)
#   GRKV_RAY_TEMP_DIR         Ray --temp-dir                    (default <state>/ray, if short enough)
#   GRKV_MLFLOW_PORT          MLflow tracking server port       (default 5000)
#   GRKV_MLFLOW_WORKERS       MLflow server worker processes    (default 1)
#   GRKV_MLFLOW_JOB_EXECUTION MLflow server job runner (GenAI judges; not used here) (default false)
#   GRKV_POSTGRES            1: a PostgreSQL server of the stack's own (infra/local/postgres.sh, its GRKV_POSTGRES_*
#                             settings) holds MLflow's backend store and the sweeps' Optuna storage (default 0: SQLite
#                             for MLflow, each sweep's Optuna journal in its state directory)
#   GRKV_START_TIMEOUT        seconds to wait for both services (default 180)
#   GRKV_STOP_TIMEOUT         seconds to wait for a clean stop  (default 40)

GRKV_HOST=127.0.0.1

_common_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$_common_dir/../.." && pwd)

die() { echo "grkv-local: error: $*" >&2; exit 1; }
info() { echo "grkv-local: $*"; }

DEFAULT_STATE_DIR="$HOME/.grkv/local"
STATE_DIR=${GRKV_STATE_DIR:-$DEFAULT_STATE_DIR}
case "$STATE_DIR" in
  /*) ;;
  *) STATE_DIR="$PWD/$STATE_DIR" ;;
esac

RAY_PID_FILE="$STATE_DIR/ray.pid"
MLFLOW_PID_FILE="$STATE_DIR/mlflow.pid"
RAY_LOG="$STATE_DIR/ray.log"
MLFLOW_LOG="$STATE_DIR/mlflow.log"
ENDPOINTS_FILE="$STATE_DIR/endpoints.env"
ENV_FILE="$STATE_DIR/env.sh"
LOCK_FILE="$STATE_DIR/.lock"

# Binaries: GRKV_VENV's (scripts/floors.sh sets its .venv-floors), else the repo's virtual environment when it exists,
# otherwise whatever is on PATH.
if [[ -d "${GRKV_VENV:-$REPO_ROOT/.venv}/bin" ]]; then
  VENV_BIN="${GRKV_VENV:-$REPO_ROOT/.venv}/bin"
  # Ray job entrypoints (`python sweep.py ...`) inherit the PATH of the Ray head, so `python`
  # must resolve to the venv's interpreter, not to a system one without ray/mlflow/optuna.
  export PATH="$VENV_BIN:$PATH"
  RAY_BIN="$VENV_BIN/ray"
  MLFLOW_BIN="$VENV_BIN/mlflow"
  PYTHON_BIN="$VENV_BIN/python"
else
  VENV_BIN=""
  RAY_BIN=$(command -v ray || true)
  MLFLOW_BIN=$(command -v mlflow || true)
  PYTHON_BIN=$(command -v python3 || command -v python || true)
fi

require_binaries() {
  local hint="install the sweep extras (pip install '.[sweep]') or create $REPO_ROOT/.venv"
  [[ -n "$PYTHON_BIN" && -x "$PYTHON_BIN" ]] || die "python not found ($hint)"
  [[ -n "$RAY_BIN" && -x "$RAY_BIN" ]] || die "'ray' not found${VENV_BIN:+ in $VENV_BIN} ($hint)"
  [[ -n "$MLFLOW_BIN" && -x "$MLFLOW_BIN" ]] || die "'mlflow' not found${VENV_BIN:+ in $VENV_BIN} ($hint)"
}

is_port() { [[ "$1" =~ ^[0-9]+$ ]] && (( $1 >= 1 && $1 <= 65535 )); }

# pid_of FILE -> prints the pid recorded in FILE (nothing if absent/garbled).
pid_of() {
  local f=$1 pid
  [[ -f "$f" ]] || return 0
  pid=$(head -n1 "$f" 2>/dev/null | tr -dc '0-9')
  [[ -n "$pid" ]] && echo "$pid"
  return 0
}

# alive PID WORD -> true if PID runs and its command line mentions WORD (guards against pid reuse).
alive() {
  local pid=$1 word=$2
  [[ -n "$pid" ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  if [[ -r "/proc/$pid/cmdline" ]]; then
    local cmd
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ "$cmd" == *"$word"* ]] || return 1
  fi
  return 0
}

# group_pids PGID -> pids of every live (non-zombie) process still in process group PGID.
group_pids() {
  ps -eo pid=,pgid=,stat= 2>/dev/null | awk -v g="$1" '$2 == g && $3 !~ /^Z/ { print $1 }'
}

# close_inherited_fds: close every descriptor of this shell above stderr. A server started after it holds none of
# its caller's files for its whole life: a lock on one (start.sh's $LOCK_FILE, a `flock FILE bash ...` around the
# script) would otherwise stay taken until the server stops. Run it in the subshell that starts the server.
close_inherited_fds() {
  local fd
  for fd in $(ls "/proc/$BASHPID/fd"); do
    if (( fd > 2 && fd < 255 )); then eval "exec $fd>&-"; fi
  done
  return 0
}

# lock: serialise start/stop on the same state dir. The lock fd (9) is closed in the services
# we launch (close_inherited_fds), so they never hold it.
# A start waits for another's (which waits for its services to answer, up to GRKV_START_TIMEOUT) rather than failing.
take_lock() {
  mkdir -p "$STATE_DIR"
  exec 9>"$LOCK_FILE"
  if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
    local wait_s=${GRKV_LOCK_WAIT:-600}
    info "another start/stop of $STATE_DIR runs (it holds $LOCK_FILE); waiting for it, up to ${wait_s}s"
    if ! flock -w "$wait_s" 9; then
      echo "grkv-local: error: another start/stop has held $LOCK_FILE for ${wait_s}s; is one stuck? (GRKV_LOCK_WAIT)" >&2
      exit 3
    fi
  fi
}

stop_timeout=${GRKV_STOP_TIMEOUT:-40}
# stop_service NAME PIDFILE WORD: stop the process group recorded in PIDFILE (its leader's command line
# mentions WORD), leader first, SIGKILL for what outlives GRKV_STOP_TIMEOUT. Counts into the caller's
# `stopped`; sets the caller's `failed` when something survives.
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
