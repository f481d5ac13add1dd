"""What the per-head cache costs on the CPU: prefill and decoding under a head-adaptive press, kvpress's masked layout
against each head's kept rows only (``PerHeadCachePress``).

    python -m benchmarks.per_head_speed                        # SmolLM2-135M, AdaKV at 10%, 2K tokens, 64 new
    python -m benchmarks.per_head_speed --processes 3 --output benchmarks/results/per-head/cpu.json

Every round prefills the same ``--prompt-tokens`` essay tokens under the press and decodes ``--new-tokens`` greedy
tokens, once in each layout, in turn, so both share the round's load; the first round of each process is an untimed
warm-up. Printed per layout: the median prefill seconds and decode milliseconds per token over the rounds of every
process, and the median of the per-round ratios to the masked layout; beside them the cache's bytes after the prefill.
``--processes`` runs the rounds in that many fresh processes one after another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from benchmarks.prefill_cost import essay_prompt
from benchmarks.worker_processes import add_round_arguments, worker_results, write_summary
from grkv_core.models import load_model
from grkv_core.presses.from_config import build_press
from grkv_core.presses.per_head_cache import PerHeadCachePress

LAYOUTS = ("masked", "per-head")


def timed_round(model, press, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Prefill ``prompt`` under ``press``, then ``new_tokens`` greedy tokens: seconds, ms per token, cache bytes."""
    cache = DynamicCache()
    with torch.inference_mode():
        start = time.perf_counter()
        with press(model):
            output = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        token = output.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
            output = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[position]]))
            token = output.logits[:, -1:].argmax(-1)
        decode_ms = 1e3 * (time.perf_counter() - start) / new_tokens
    return {"prefill_s": prefill_s, "decode_ms_per_token": decode_ms, "kv_bytes": kv_bytes}


def run_rounds(args) -> dict[str, list[dict]]:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32", device="cpu")
    prompt = essay_prompt(loaded.tokenizer, args.prompt_tokens)
    rounds: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for round_index in range(args.rounds + 1):
        for layout in LAYOUTS:
            press = build_press(args.press, args.compression_ratio, args.merge)
            press = PerHeadCachePress(press) if layout == "per-head" else press
            found = timed_round(loaded.model, press, prompt, args.new_tokens)
            if round_index:
                rounds[layout].append(found)
    return rounds


def summarize(rounds: dict[str, list[dict]]) -> dict:
    summary = {}
    for layout, found in rounds.items():
        row = {"rounds": len(found), "kv_bytes": found[0]["kv_bytes"]}
        for key in ("prefill_s", "decode_ms_per_token"):
            row[key] = statistics.median(item[key] for item in found)
            ratios = [item[key] / masked[key] for item, masked in zip(found, rounds["masked"])]
            row[f"{key}_ratio"] = statistics.median(ratios)
            row[f"{key}_ratios"] = ratios
        summary[layout] = row
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--press", default="adakv")
    parser.add_argument("--merge", default="none")
    parser.add_argument("--compression-ratio", type=float, default=0.9)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_round_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_rounds(args)))
        return 0
    rounds: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for found in worker_results("benchmarks.per_head_speed", sys.argv[1:], args.processes):
        for layout in LAYOUTS:
            rounds[layout] += found[layout]
    summary = summarize(rounds)
    merged = "" if args.merge == "none" else f" + {args.merge}"
    print(
        f"{args.model}, {args.press}{merged} at {1 - args.compression_ratio:.0%} kept, {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new, {args.threads} threads, {args.processes} process(es) x {args.rounds} rounds"
    )
    print("| layout | KV MiB | prefill s | ratio | decode ms/token | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout, row in summary.items():
        print(
            f"| {layout} | {row['kv_bytes'] / 2**20:.2f} | {row['prefill_s']:.3f} | {row['prefill_s_ratio']:.3f} | "
            f"{row['decode_ms_per_token']:.2f} | {row['decode_ms_per_token_ratio']:.3f} |"
        )
    write_summary(args.output, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
