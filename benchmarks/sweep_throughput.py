"""Trials per hour of the trial engine against the per-trial path, side by side, on one fixed list of trials.

    .venv/bin/python -m benchmarks.sweep_throughput --samples 4 \
        --output benchmarks/results/sweep-throughput.json

The same trials (SnapKV at two budgets alone, the paper's GRKV, and GRKV variants: 24 by default) are evaluated
on the same samples (offline RULER needle tasks at 2K, SmolLM2 by default) two ways, sample by sample and in
turn, so that the shared cores' noise falls on both alike:

- per trial: ``Evaluator.evaluate_sample`` for each trial, its own prefill and batch-1 decoding (what every
  trial of a sweep cost before the engine; its predictions and losses equal the earlier code's bit for bit);
- engine: ``Evaluator.evaluate_trials`` with all trials at once, one prefill and batched decoding.

In three modes: full (decoding and scoring, every metric), screening (reconstruction losses and answer metrics, no
decoding) and answer (the answer metrics alone: the question and reference answer teacher-forced on each cache). The
script checks that the per-sample results are identical: predictions, scores, memory, window and question losses
exactly; the held-out loss within 1e-5 relative (its queries come from the decoding's hidden states, which a batched
matmul may round differently in the last bit), and the answer metrics within 1e-5 (absolute; top-1 exactly), since
the engine teacher-forces caches of one budget as one batch. In half precision the answer metrics agree to
``BATCHED_RTOL``, and neither the decoded fields nor the held-out loss are compared (``BATCHED_RTOL``'s note). It
prints the largest answer-metric difference, and the throughput of answer-metric trials on the engine against full
scoring trials on either path. It exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm.auto import tqdm

from grkv_core.config import PressConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.models import load_model
from grkv_core.options import PAPER_GRKV_OPTIONS

EXACT_FIELDS = (
    "predictions",
    "scores",
    "score",
    "kv_bytes",
    "window_loss",
    "question_loss",
    "generated_tokens",
    "answer_top1",
)
# NOTE: what a greedy decode or an argmax yields can flip on a rounding difference at a near tie
DECODED_FIELDS = ("predictions", "scores", "score", "generated_tokens", "answer_top1")
HELDOUT_RTOL = 1e-5
ANSWER_ATOL = 1e-5
# In half precision the engine's batched forwards round differently from single-trial ones (GPU kernels are not
# batch-invariant): float metrics then agree to the format's precision, not bit for bit (docs/results/gpu.md).
# NOTE: but for the held-out loss, which like the decoded fields is not compared there: its queries come from each
# cache's own decoding, and in bfloat16 either path measures it only to a few percent of its float64 value (median
# 3.3%, up to 30%; the engine as precisely as the per-trial path: benchmarks/heldout_precision.py,
# docs/results/critical-path.md), so a difference of the two beyond 2⁻⁸ tells nothing about the engine.
BATCHED_RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-10}
# mode -> Evaluator.evaluate_trials arguments
MODES = {
    "full": dict(decode=True),
    "screening": dict(decode=False),
    "answer": dict(decode=False, measure_reconstruction=False),
}
NEEDLE_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue")


def needle_samples(tokenizer, context_length: int, count: int) -> list:
    """The first ``count`` offline RULER needle samples at ``context_length`` tokens (seed 0), the tasks in turn."""
    per_task = math.ceil(count / len(NEEDLE_TASKS))
    samples = load_dataset_samples(
        "ruler",
        tasks=NEEDLE_TASKS,
        context_length=context_length,
        samples_per_task=per_task,
        seed=0,
        tokenizer=tokenizer,
    )
    return [samples[i * per_task + j] for j in range(per_task) for i in range(len(NEEDLE_TASKS))][:count]


def fixed_trials(press: str, ratio: float, wider_ratio: float) -> list[PressConfig]:
    """48 trials: the press alone at two budgets, the paper's GRKV, 21 GRKV variants a sweep would propose
    (one option moved at a time: the first 24 are the default batch), then 24 combinations of several moved
    together."""
    variants = [
        {},
        {"safeguard": False},
        {"lambda_k": 0.0},
        {"lambda_k": 1.0, "lambda_v": 0.1},
        {"lambda_k": 1e-3},
        {"beta": 0.0},
        {"beta": 0.3},
        {"window_size": 16},
        {"window_size": 64},
        {"steps": 2},
        {"components": "v"},
        {"components": "k"},
        {"ridge_scale": "relative"},
        {"lambda_v": 1.0},
        {"lambda_v": 1e-3},
        {"n_sink": 0},
        {"accept": "objective"},
        {"cg_max_iter": 16},
        {"query_policy": "stratified"},
        {"lambda_k": 0.1, "beta": 0.2},
        {"max_rel_update_k": 0.025, "max_rel_update_v": 0.1},
        *(
            {"lambda_k": lambda_k, "beta": beta, "window_size": window}
            for lambda_k in (1e-3, 0.1, 1.0)
            for beta in (0.1, 0.2)
            for window in (16, 32, 64)
        ),
        *(
            {"steps": 2, "lambda_v": lambda_v, "components": components}
            for lambda_v in (1e-3, 1e-2, 0.1)
            for components in ("kv", "v")
        ),
    ]
    return [
        PressConfig(press, ratio),
        PressConfig(press, wider_ratio),
        PressConfig(press, ratio, "grkv", dict(PAPER_GRKV_OPTIONS), variant="paper"),
        *(PressConfig(press, ratio, "grkv", options) for options in variants),
    ]


def mismatches(engine, alone, rtol: float | None = None) -> tuple[list[str], float]:
    """The differences beyond tolerance between the engine's and the per-trial results, and the largest absolute
    difference of an answer NLL or KL. ``rtol`` (``BATCHED_RTOL`` of a half-precision model): the answer metrics
    agree to this relative tolerance and neither the decoded fields nor the held-out loss are compared; ``None``:
    every field as exactly as float32 allows."""
    exact = EXACT_FIELDS if rtol is None else tuple(name for name in EXACT_FIELDS if name not in DECODED_FIELDS)
    found, largest = [], 0.0
    for ours, theirs in zip(engine, alone):
        ours, theirs = asdict(ours), asdict(theirs)
        found += [
            f"{ours['sample_id']}: {name} {ours[name]!r} != {theirs[name]!r}"
            for name in exact
            if ours[name] != theirs[name]
        ]
        for name in ("answer_nll", "answer_kl") if rtol is not None else ("heldout_loss", "answer_nll", "answer_kl"):
            a, b = ours[name], theirs[name]
            if (a is None) != (b is None):
                found.append(f"{ours['sample_id']}: {name} {a!r} != {b!r}")
                continue
            if a is None:
                continue
            if rtol is not None:
                close = math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
            elif name == "heldout_loss":
                close = math.isclose(a, b, rel_tol=HELDOUT_RTOL, abs_tol=1e-12)
            else:
                close = abs(a - b) <= ANSWER_ATOL
            if not close:
                found.append(f"{ours['sample_id']}: {name} {a!r} != {b!r}")
            elif name != "heldout_loss":
                largest = max(largest, abs(a - b))
    return found, largest


def both_paths(
    evaluator: Evaluator, sample, trials: list[PressConfig], mode: str
) -> tuple[float, float, list[str], float]:
    """``trials`` on ``sample`` each with its own prefill, then all on the engine: the seconds of each path, the
    differences beyond tolerance and the largest answer-metric difference (``mismatches``, to the model's
    ``BATCHED_RTOL`` in half precision)."""
    started = time.perf_counter()
    alone = [evaluator.evaluate_trials(sample, [trial], **MODES[mode])[0] for trial in trials]
    per_trial = time.perf_counter() - started
    started = time.perf_counter()
    engine = evaluator.evaluate_trials(sample, trials, **MODES[mode])
    rtol = BATCHED_RTOL.get(evaluator.loaded.dtype)
    return (per_trial, time.perf_counter() - started, *mismatches(engine, alone, rtol))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4, help="samples in all (spread over the needle tasks)")
    parser.add_argument("--trials", type=int, default=24, help="the first N of the fixed list of trials")
    parser.add_argument("--press", default="snapkv")
    parser.add_argument("--ratio", type=float, default=0.9, help="compression ratio of the trials (0.9: keep 10%%)")
    parser.add_argument("--wider-ratio", type=float, default=0.88, help="the press alone at a larger budget b' > b")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    samples = needle_samples(loaded.tokenizer, args.context_length, args.samples)
    trials = fixed_trials(args.press, args.ratio, args.wider_ratio)[: args.trials]
    evaluator = Evaluator(loaded)
    seconds = {(mode, path): 0.0 for mode in args.modes for path in ("per_trial", "engine")}
    problems, largest = [], 0.0
    for sample in tqdm(samples, desc="samples", unit="sample"):
        for mode in args.modes:
            per_trial, engine, found, difference = both_paths(evaluator, sample, trials, mode)
            seconds[mode, "per_trial"] += per_trial
            seconds[mode, "engine"] += engine
            problems += [f"{mode}: {problem}" for problem in found]
            largest = max(largest, difference)

    figures = {
        "model": args.model,
        "device": str(loaded.model.device),
        "dtype": str(loaded.dtype),
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "context_length": args.context_length,
        "samples": len(samples),
        "trials": len(trials),
        "modes": {},
    }
    print(
        f"{len(trials)} trials x {len(samples)} samples, {args.model} on {loaded.model.device}, "
        f"{args.context_length} tokens, {torch.get_num_threads()} threads"
    )
    print(
        f"{'mode':10s} {'per-trial s':>11s} {'engine s':>9s} {'trials/h per-trial':>19s} {'trials/h engine':>16s} "
        f"{'ratio':>6s}"
    )
    for mode in args.modes:
        per_trial, engine = seconds[mode, "per_trial"], seconds[mode, "engine"]
        rates = [3600 * len(trials) / value for value in (per_trial, engine)]
        figures["modes"][mode] = {
            "per_trial_s": per_trial,
            "engine_s": engine,
            "trials_per_hour_per_trial": rates[0],
            "trials_per_hour_engine": rates[1],
            "ratio": per_trial / engine,
        }
        print(
            f"{mode:10s} {per_trial:11.1f} {engine:9.1f} {rates[0]:19.0f} {rates[1]:16.0f} {per_trial / engine:5.1f}x"
        )
    if "answer" in args.modes and "full" in args.modes:
        answer = seconds["answer", "engine"]
        figures["answer_vs_full"] = {path: seconds["full", path] / answer for path in ("per_trial", "engine")}
        print(
            f"answer-metric trials on the engine vs full scoring trials: "
            f"{figures['answer_vs_full']['engine']:.1f}x the engine's, "
            f"{figures['answer_vs_full']['per_trial']:.1f}x the per-trial path's throughput"
        )
    rtol = BATCHED_RTOL.get(loaded.dtype)
    tolerance = "exact" if rtol is None else f"to relative {rtol:.2g}, decoded fields not compared"
    figures["identical"] = not problems
    figures["tolerance"] = tolerance
    figures["largest_answer_difference"] = largest
    print(
        f"per-sample results identical ({tolerance}): "
        + ("yes" if not problems else f"NO ({len(problems)} differences)")
        + f" (answer NLL/KL: largest difference {largest:.2g})"
    )
    for problem in problems[:20]:
        print("  " + problem)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({**figures, "differences": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
