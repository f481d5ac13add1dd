#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the lent GPU machines, which reach no package registry. Their image
# has torch 2.11 (CUDA 13), transformers 5.17 and tokenizers 0.23.2; kvpress 0.5.5 pins transformers < 5.3, and
# transformers 5.2.0 checks tokenizers <= 0.23.0 at import. So: transformers 5.2.0, tokenizers 0.22.2, kvpress
# 0.5.5 and the small packages kvpress imports that the image lacks (cachetools, datasets and its dill and
# multiprocess, fire and its termcolor) and the RULER generator's wonderwords and needlehaystack, all without
# their dependencies, into .gpu-wheels/ (ignored by git; about 15 MiB, under the device's 64 MiB carry limit).
# Then, with the device tool (README, "On a GPU"):
#   carry [".gpu-wheels"], command:
#   python3 -m pip install -q --upgrade --no-deps --no-index --target /tmp/grkv-site .gpu-wheels/*.whl && \
#     PYTHONPATH=/tmp/grkv-site:. python3 -m benchmarks.gpu_check --device cuda --output-dir $OUT/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-wheels
python3 -m pip download -q --no-deps --only-binary :all: --dest .gpu-wheels \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --python-version 3.12 --implementation cp \
  transformers==5.2.0 tokenizers==0.22.2 kvpress==0.5.5 cachetools==5.5.2 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 fire==0.7.1 termcolor==3.3.0 wonderwords==3.0.1 needlehaystack==0.1.0
du -sh .gpu-wheels
ls .gpu-wheels
