#!/usr/bin/env bash
# On a lent GPU machine, from the repository's root, with .gpu-wheels carried (built here by scripts/gpu_wheels.sh):
# install the carried wheels into the image's Python (it reaches no package registry), then the project itself, built
# in pip's isolated build environment with the carried setuptools (.gpu-wheels/build/). Both with --no-deps: the
# image's own packages (torch first) stay as they are.
#   bash scripts/gpu_install.sh && python3 -m benchmarks.gpu_check --device cuda --output-dir $OUT/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python3 -m pip install -q --disable-pip-version-check --no-index --no-deps)
"${pip[@]}" .gpu-wheels/*.whl
"${pip[@]}" --find-links .gpu-wheels/build .
# NOTE: --no-deps checks no declared range against the image's versions; pip's own check names any the image misses
# (among the project's requirements and the carried packages'), for the run's log. The run goes on regardless.
python3 -m pip check | grep -iE "^(grkv|kvpress|transformers|tokenizers|datasets|pydantic|rouge-score|nltk) " || true
