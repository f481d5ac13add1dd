"""What GRKV adds to a prefill, operation by operation: how many operations it dispatches, from where, and their
own CPU time, against the base press alone (the same essay prompt as ``prefill_cost.py``).

    PYTHONPATH=benchmarks:. python benchmarks/prefill_ops.py                          # SmolLM2-135M, SnapKV 10%
    PYTHONPATH=benchmarks:. python benchmarks/prefill_ops.py --option layers_per_solve=0

Counts come from a ``TorchDispatchMode`` over one prefill (each operation attributed to the nearest grkv_core or
kvpress function on the stack); times from ``torch.profiler`` over ``--rounds`` prefills (self CPU time per
operation, per prefill). The model's own operations are the same under both presses, so their time differences
are noise; the operations GRKV adds are the rows whose call counts differ.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from grkv_core.cli import parse_merge_variant
from grkv_core.generation import prefill
from grkv_core.models import load_model
from grkv_core.registry import build_press
from prefill_cost import add_prefill_arguments, essay_prompt


class CountedOperations(TorchDispatchMode):
    """Counts every dispatched operation by the nearest grkv_core or kvpress function that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not any(part in frame.f_code.co_filename for part in ("grkv_core", "kvpress")):
            frame = frame.f_back
        caller = "model" if frame is None else f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"
        self.by_caller[caller] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prefill_arguments(parser, rounds=3)
    parser.add_argument("--option", default="", metavar="k=v,...", help="GRKV options, e.g. layers_per_solve=0")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    loaded = load_model(args.model)
    ids = essay_prompt(loaded.tokenizer, args.tokens)
    _, merge, options = parse_merge_variant(f"grkv=grkv:{args.option}" if args.option else "grkv=grkv")
    presses = {"base": build_press(args.press, args.compression_ratio),
               "grkv": build_press(args.press, args.compression_ratio, merge=merge, **options)}
    counts, times = {}, {}
    for name, press in presses.items():
        prefill(loaded.model, ids, press)  # warm-up
        with CountedOperations() as counted:
            prefill(loaded.model, ids, press)
        counts[name] = counted.by_caller
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(args.rounds):
                prefill(loaded.model, ids, press)
        times[name] = {event.key: (event.count / args.rounds, event.self_cpu_time_total / args.rounds / 1000)
                       for event in profiled.key_averages()}
    print(f"model={args.model} tokens={args.tokens} press={args.press} keep={1 - args.compression_ratio:.0%} "
          f"grkv options={options or 'defaults'} threads={torch.get_num_threads()} rounds={args.rounds}")
    print(f"dispatched operations per prefill: base {sum(counts['base'].values())}, "
          f"+grkv {sum(counts['grkv'].values())}")
    print("\nadded operations by caller (grkv - base)")
    added = counts["grkv"].copy()
    added.subtract(counts["base"])
    for caller, count in added.most_common(args.top):
        print(f"{count:8d}  {caller}")
    print("\noperations whose calls GRKV adds: +calls and +self CPU ms per prefill")
    rows = []
    for key in set(times["base"]) | set(times["grkv"]):
        base_calls, base_ms = times["base"].get(key, (0, 0.0))
        grkv_calls, grkv_ms = times["grkv"].get(key, (0, 0.0))
        if grkv_calls != base_calls:
            rows.append((grkv_ms - base_ms, grkv_calls - base_calls, key))
    for extra_ms, extra_calls, key in sorted(rows, reverse=True)[:args.top]:
        print(f"{key[:44]:44s} {extra_calls:+8.0f} {extra_ms:+9.2f}")
    print(f"{'total':44s} {sum(row[1] for row in rows):+8.0f} {sum(row[0] for row in rows):+9.2f}")


if __name__ == "__main__":
    main()
