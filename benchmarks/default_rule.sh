#!/usr/bin/env bash
# The runs of GRKV's default selection (docs/results/default-rule.md): every candidate behind SnapKV at 10%, 20% and
# 50% and PyramidKV at 20%, on SmolLM2-135M (80 samples) and Gemma 3 270M (40), both protocols, answer metrics only.
#   bash benchmarks/default_rule.sh [OUTPUT_DIR]            # default benchmarks/results/default-rule; resumable
#   bash benchmarks/default_rule.sh confirm [OUTPUT_DIR]    # the confirmation: the library's default on a fresh seed
#   .venv/bin/python -m benchmarks.default_rule benchmarks/results/default-rule
# Each `grkv compare` resumes per sample from its result files, so a stopped run goes on where it stopped. Every
# candidate names every option that any candidate varies (the rest at the defaults of the rule's date, 2026-11-28).
# The confirmation runs the same SmolLM2 cells with the library's default row (`GRKVPress(press)` as it now is) on
# seed 13, which no earlier run drew from, 10 samples per task (n = 40 per cell).
set -euo pipefail
cd "$(dirname "$0")/.."
base="lambda_k=0.01,lambda_v=0.01,beta=0.1,safeguard=true,cg_max_iter=4,cg_rtol=1e-6,max_rel_update_k=null"
base="$base,max_rel_update_v=null,head_weighting=uniform,query_policy=window,window_size=32"
candidates=(
  "window32=grkv:$base"
  "lambda1=grkv:$base,lambda_k=1,lambda_v=1"
  "stratified64=grkv:$base,query_policy=stratified,window_size=64"
  "stratified128=grkv:$base,query_policy=stratified,window_size=128"
  "mixture128=grkv:$base,query_policy=mixture,window_size=128"
  "expected128=grkv:$base,query_policy=expected,window_size=128"
  "sweep-qa8=grkv:$base,lambda_k=0.07242,lambda_v=0.03184,beta=0.2188,query_policy=stratified,window_size=128,max_rel_update_v=0.3,head_weighting=o_proj"
  "sweep-qag2=grkv:$base,lambda_k=0.002498,lambda_v=0.00132,beta=0.008825,query_policy=stratified,window_size=64,max_rel_update_k=0.1,head_weighting=o_proj"
)
if [[ "${1:-}" == confirm ]]; then
  out="${2:-benchmarks/results/default-confirmation}"
  seed=13
  rows=()
  declare -A samples=([smollm2-135m]=10)
else
  out="${1:-benchmarks/results/default-rule}"
  seed=3
  rows=(--only-variants)
  for candidate in "${candidates[@]}"; do rows+=(--merge-variant "$candidate"); done
  declare -A samples=([smollm2-135m]=20 [gemma3-270m]=10)  # per task, 4 tasks
fi
# NOTE: the 20% cells first (the earlier findings' budget), then the other base press, then 10% and 50%.
for step in "snapkv 0.8" "pyramidkv 0.8" "snapkv 0.9" "snapkv 0.5"; do
  read -r press ratio <<<"$step"
  for model in smollm2-135m gemma3-270m; do
    [[ -n "${samples[$model]:-}" ]] || continue
    for protocol in query_aware question_agnostic; do
      echo "$(date -u +%H:%M:%S) $model $protocol $press $ratio"
      HF_HUB_OFFLINE=1 .venv/bin/grkv compare --model "$model" --tasks niah_single_1 niah_single_2 niah_multivalue \
        niah_multiquery --samples "${samples[$model]}" --seed "$seed" --context-length 2048 --press "$press" \
        --compression-ratios "$ratio" --protocol "$protocol" --no-decode --no-progress "${rows[@]}" \
        --output-dir "$out/$model/$protocol" >/dev/null
    done
  done
done
echo "$(date -u +%H:%M:%S) done"
