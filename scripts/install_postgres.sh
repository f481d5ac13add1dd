#!/usr/bin/env bash
# PostgreSQL's server, which the storage tests start on loopback (tests/conftest.py, infra/local/postgres.sh): installed
# from Debian's packages where a machine lacks it (as root), else nothing is done.
set -euo pipefail
if command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "grkv: PostgreSQL's server is not installed; install it (Debian: apt install postgresql) for the storage tests" >&2
  exit 0
fi
echo "grkv: installing PostgreSQL's server (Debian's postgresql) for the storage tests"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null \
  || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null; }
