#!/usr/bin/env bash
# Issue #50's GPU bars in one run of under 10 minutes on an H100 or H200 (the machine's start aside):
#   bash scripts/gpu_wheels.sh                        # here: the 20 MiB of wheels to carry (.gpu-wheels, ignored)
#   bash benchmarks/gpu_speed.sh "$OUT"              # there, from the repository root, with .gpu-wheels carried
#   bash benchmarks/gpu_speed.sh "$OUT" per-head     # issue #60's note instead, in a call apart (under 4 minutes):
#     benchmarks/gpu_per_head.py, decoding over the per-head cache against the masked layout at 32K x 1
# gpu_check.py's parity (the solve against float64 and a captured graph against eager), its prefill rows at 4K × 1,
# 32K × 1 and 4K × 4 (SnapKV 10% alone; + GRKV's defaults, layers_per_solve 1, the solves on a side stream with all
# layers in one solve and in groups of 8, and the default until 2026-11-28, preset window32: the time to first token and to the second token, timed with CUDA events
# and no synchronisation inside the rounds, and their ratios; the first request's graph capture against a warm
# request; in an instrumented pass apart, the merge's ms per layer with its hooks synchronised, the synced TTFT ratio
# of earlier pages, the kernels, kernel ms and synchronisations GRKV adds per layer, peak allocated and reserved
# memory; after each row the memory reserved and in CUDA graph pools), the trial engine and the out-of-memory batch.
# The bars (gpu_check's "bars" section says whether each holds):
#   defaults: TTFT ratio <= 1.05 at 4K × 1, <= 1.02 at 32K × 1, <= 1.08 at 4K × 4; the time to the second token's
#   ratio within the same bounds; preset window32: TTFT ratio <= 1.03 at 4K × 1, <= 1.01 at 32K × 1;
#   CUDA graph pools <= 2 GiB after the 4K and 32K rows; SnapKV + GRKV's peak reserved memory within 1 GiB of
#   SnapKV's at 32K × 1.
set -euo pipefail
out="${1:?usage: bash benchmarks/gpu_speed.sh OUTPUT_DIR [check|per-head]}"
part="${2:-check}"
mkdir -p "$out"
bash scripts/gpu_install.sh 2>&1 | tee "$out/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
if [ "$part" = per-head ]; then
    HF_HUB_OFFLINE=1 timeout 240 python3 -m benchmarks.gpu_per_head --device cuda --output-dir "$out/per-head" \
        2>&1 | tee "$out/per-head.log"
    exit 0
fi
HF_HUB_OFFLINE=1 timeout 540 python3 -m benchmarks.gpu_check --device cuda \
    --rows 4096x1 32768x1 4096x4 --rounds 5 --synced-rounds 2 --decode-tokens 4 --engine-trials 8 \
    --query-policies --presets window32 --output-dir "$out/gpu-check" \
    2>&1 | tee "$out/gpu-check.log"
