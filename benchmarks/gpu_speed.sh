#!/usr/bin/env bash
# Issue #43's GPU bars in one run of under 10 minutes on an H100 or H200 (the machine's start aside):
#   bash scripts/gpu_wheels.sh                        # here: the 15 MiB of wheels to carry (.gpu-wheels, ignored)
#   bash benchmarks/gpu_speed.sh "$OUT"              # there, from the repository root, with .gpu-wheels carried
# gpu_check.py's parity (the solve against float64 and a captured graph against eager), its prefill rows at 4K × 1
# and 32K × 1 (SnapKV 10% alone; + GRKV's defaults, layers_per_solve 1 and 6, stratified m = 128, and the default
# until 2026-11-28, preset window32; TTFT ratios, the kernels, kernel ms and synchronisations GRKV adds per layer),
# the trial engine and the out-of-memory batch.
# The bars: TTFT ratio <= 1.08 at 4K × 1 and <= 1.015 at 32K × 1 for the defaults, <= 1.15 at 4K × 1 for stratified.
set -euo pipefail
out="${1:?usage: bash benchmarks/gpu_speed.sh OUTPUT_DIR}"
mkdir -p "$out"
python3 -m pip install -q --upgrade --no-deps --no-index --target /tmp/grkv-site .gpu-wheels/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
PYTHONPATH=/tmp/grkv-site:. HF_HUB_OFFLINE=1 timeout 540 python3 benchmarks/gpu_check.py --device cuda \
    --contexts 4096 32768 --batches 1 --rounds 5 --decode-tokens 4 --engine-trials 8 --presets window32 \
    --output-dir "$out/gpu-check" \
    2>&1 | tee "$out/gpu-check.log"
