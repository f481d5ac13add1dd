"""What merging while decoding costs: greedy decoding under a bounded cache, eviction alone and with a merger behind it.

    python -m benchmarks.decoding_cost                                  # SmolLM2-135M, target 512, interval 128, CPU
    python -m benchmarks.decoding_cost --processes 3 --output benchmarks/results/decoding-cost/cpu.json

Every round decodes ``--new-tokens`` tokens after the same ``--prompt-tokens`` essay tokens once under each press, in
turn (``MergingDecodingPress``: the eviction press alone, then behind each merger), so the presses of a round share
that round's load; the first round of each process is an untimed warm-up. Printed per press: the median decode time
per token over the rounds of every process (all steps, compressions included), the median of the per-round ratios to
eviction alone, and what one compression costs (a compressing step's time less the median plain step's, averaged
over the compressions). ``--processes`` runs the rounds in that many fresh processes one after another (a process's
allocator and caches are its own). The prompt holds ``target_size`` tokens, so the first compression comes after the
first ``compression_interval`` decoded tokens and every later one ``compression_interval`` tokens after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.prefill_cost import essay_prompt
from benchmarks.worker_processes import add_round_arguments, worker_results, write_summary
from grkv_core.merger_flags import parse_merge_variant
from grkv_core.models import load_model
from grkv_core.presses import MergingDecodingPress
from grkv_core.presses.from_config import build_press


def decode_steps(model, press, prompt: torch.Tensor, new_tokens: int) -> list[float]:
    """Greedy decoding of ``new_tokens`` after ``prompt`` under ``press``: each decoding step's wall seconds."""
    steps = []
    with press(model), torch.inference_mode():
        output = model(input_ids=prompt, use_cache=True)
        cache, token = output.past_key_values, output.logits[:, -1:].argmax(-1)
        for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
            start = time.perf_counter()
            output = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[position]]))
            token = output.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - start)
    return steps


def run_rounds(args) -> dict:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32", device="cpu")
    prompt = essay_prompt(loaded.tokenizer, args.target_size)
    presses = {"evict": build_press(args.press, 0.0)}
    for text in args.merge:
        name, merge, options = parse_merge_variant(text)
        presses[name] = build_press(args.press, 0.0, merge, **options)
    steps: dict[str, list[list[float]]] = {name: [] for name in presses}
    for round_index in range(args.rounds + 1):
        for name, base in presses.items():
            press = MergingDecodingPress(
                base, compression_interval=args.interval, target_size=args.target_size, hidden_states_buffer_size=256
            )
            timed = decode_steps(loaded.model, press, prompt, args.new_tokens)
            if round_index:
                steps[name].append(timed)
    return steps


def summarize(steps: dict[str, list[list[float]]], interval: int) -> dict:
    """Per press: median ms per token, median per-round ratio to eviction alone, ms per compression."""
    summary = {}
    for name, rounds in steps.items():
        per_token = [1e3 * sum(timed) / len(timed) for timed in rounds]
        ratios = [sum(timed) / sum(base) for timed, base in zip(rounds, steps["evict"])]
        compressing = [index for index in range(len(rounds[0])) if (index + 1) % interval == 0]
        extra = []
        for timed in rounds:
            plain = statistics.median(t for index, t in enumerate(timed) if index not in compressing)
            extra += [1e3 * (timed[index] - plain) for index in compressing]
        summary[name] = {
            "ms_per_token": statistics.median(per_token),
            "ratio_to_evict": statistics.median(ratios),
            "ratios": ratios,
            "ms_per_compression": statistics.mean(extra),
            "compressions_per_round": len(compressing),
            "rounds": len(rounds),
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--press", default="snapkv")
    parser.add_argument("--merge", action="append", default=None, metavar="NAME=MERGE[:k=v,...]")
    parser.add_argument("--target-size", type=int, default=512)
    parser.add_argument("--interval", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    add_round_arguments(parser)
    args = parser.parse_args()
    args.merge = args.merge or ["grkv=grkv"]
    if args.worker:
        print(json.dumps(run_rounds(args)))
        return 0
    steps: dict[str, list[list[float]]] = {}
    for found in worker_results("benchmarks.decoding_cost", sys.argv[1:], args.processes):
        for name, rounds in found.items():
            steps.setdefault(name, []).extend(rounds)
    summary = summarize(steps, args.interval)
    print(
        f"{args.model}, {args.press}, target {args.target_size}, interval {args.interval}, {args.new_tokens} new "
        f"tokens, {args.threads} threads, {args.processes} process(es) x {args.rounds} rounds"
    )
    print("| press | ms/token (median) | ratio to eviction (median of rounds) | ms per compression |")
    print("|---|---:|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['ms_per_token']:.2f} | {row['ratio_to_evict']:.3f} | {row['ms_per_compression']:.1f} |")
    write_summary(args.output, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
