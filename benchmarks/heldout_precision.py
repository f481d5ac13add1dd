"""How precisely a half-precision model measures the held-out loss, against float64: the trial engine's tolerance.

    .venv/bin/python -m benchmarks.heldout_precision --samples 2 --trials 6

The same trials (``sweep_throughput.fixed_trials``) on the same samples in full mode (decoding, every metric), each
with its own prefill (the per-trial path) in float64, float32 and bfloat16, and all at once on the trial engine in
bfloat16. Per (sample, trial) it prints the held-out loss of each, and the relative differences: bfloat16 per-trial
against float64 (how precise the format measures it), the engine against float64, and the engine against the
per-trial path in bfloat16 (what ``gpu_check``'s trial-engine row compares to ``BATCHED_RTOL``). The held-out loss is a
discrepancy between two attention outputs measured on the queries of the cache's own decoding, so its relative error
is the format's relative error divided by how small the discrepancy is beside the outputs: where bfloat16's own error
on it exceeds 2⁻⁸, a tolerance of 2⁻⁸ between two bfloat16 paths is too tight.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.sweep_throughput import MODES, fixed_trials, needle_samples
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--trials", type=int, default=6, help="the first N of sweep_throughput's fixed trials")
    args = parser.parse_args()

    loaded = {name: load_model(args.model, dtype=name) for name in ("float32", "bfloat16")}
    loaded["float64"] = dataclasses.replace(
        loaded["float32"], model=copy.deepcopy(loaded["float32"].model).double(), dtype=torch.float64
    )
    samples = needle_samples(loaded["float32"].tokenizer, args.context_length, args.samples)
    trials = fixed_trials("snapkv", 0.9, 0.88)[: args.trials]
    full = MODES["full"]
    rows = []
    for sample in samples:
        losses = {
            name: [Evaluator(model).evaluate_trials(sample, [trial], **full)[0].heldout_loss for trial in trials]
            for name, model in loaded.items()
        }
        losses["engine bfloat16"] = [
            result.heldout_loss for result in Evaluator(loaded["bfloat16"]).evaluate_trials(sample, trials, **full)
        ]
        for index, trial in enumerate(trials):
            row = {name: values[index] for name, values in losses.items()}
            if row["float64"] is None:
                continue  # a trial whose cache is not compressed has no held-out loss
            rows.append((sample.sample_id, trial.variant or trial.merge or "none", row))

    def relative(a: float, b: float) -> float:
        return abs(a - b) / abs(b)

    print(
        f"{args.model}, {args.context_length} tokens, {len(samples)} samples x {len(trials)} trials, full mode, "
        f"{torch.get_num_threads()} threads"
    )
    header = ("sample", "trial", "float64", "float32", "bf16", "engine bf16", "bf16/f64", "engine/f64", "engine/bf16")
    print("  ".join(f"{text:>12s}" for text in header))
    columns = {"bf16/f64": [], "engine/f64": [], "engine/bf16": []}
    for sample_id, trial, row in rows:
        differences = (
            relative(row["bfloat16"], row["float64"]),
            relative(row["engine bfloat16"], row["float64"]),
            relative(row["engine bfloat16"], row["bfloat16"]),
        )
        for column, value in zip(columns, differences):
            columns[column].append(value)
        values = (row["float64"], row["float32"], row["bfloat16"], row["engine bfloat16"], *differences)
        print(f"{sample_id[:12]:>12s}  {trial[:12]:>12s}  " + "  ".join(f"{value:12.4g}" for value in values))
    for column, values in columns.items():
        print(f"{column}: median relative difference {statistics.median(values):.3g}, largest {max(values):.3g}")
    print(f"BATCHED_RTOL in bfloat16: {2**-8:.3g}")


if __name__ == "__main__":
    main()
