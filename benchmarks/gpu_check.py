"""GRKV on a GPU, one command, one report: parity, prefill cost, the trial engine and a forced out-of-memory batch.

    # on a GPU machine with no package registry: first `bash scripts/gpu_install.sh` (the README's GPU section)
    python -m benchmarks.gpu_check --device cuda --output-dir $OUT/gpu-check
    # anywhere, on tiny shapes: the same code path (the test suite runs it)
    python -m benchmarks.gpu_check --device cpu --tiny --output-dir /tmp/gpu-check

Four sections (and the bars), printed as they finish and written to ``gpu_check.json`` and ``gpu_check.md``:

1. **parity**: ``grkv_merge`` on the device against the float64 reference (``solver.reference``), in float32 and
   with a bfloat16 cache; the relative error of the update (‖fast − reference‖ / ‖reference − evicted‖).
2. **prefill** (``gpu_prefill.py``): a Llama-3.1-8B-shaped model with random weights (cost does not depend on the
   weights' values) in bfloat16, sdpa (and flash-attention 2 if importable), at each context × batch: SnapKV 10% alone
   against SnapKV + GRKV (defaults: every layer in one solve), with ``layers_per_solve`` 1, with the solves on a side
   stream (``merge_stream="side"``, all layers in one solve or in groups of 8), with stratified
   queries (m = 128) and with the presets asked for (``--presets window32``: the default until 2026-11-28). The time
   to first token (TTFT: from the prefill's call to the compressed cache being ready) and to the second token (one
   greedy decode step more), medians over rounds after a warm-up, timed with CUDA events and nothing synchronising
   the device inside the rounds, and their ratios to SnapKV alone's; the first request's cost (the first GRKV prefill
   of a fresh shape, which captures the solve's CUDA graphs) against a warm one; and, from passes apart from the timed
   one: the merge's ms per layer with each compression hook synchronised (and that prefill's ``synced TTFT ratio``,
   the TTFT ratio of the result pages before issue #50), the operations, host reads, kernels, kernel ms and stream
   synchronisations GRKV adds per layer, peak allocated and reserved memory, decode ms per token; after each row the
   memory reserved and held by CUDA graphs' pools. Last, issue #50's bars (``gpu_prefill.BARS``): whether each holds.
3. **trial engine**: ``benchmarks/sweep_throughput.py``'s comparison on the same model (every trial with its own
   prefill against the engine's one prefill per sample) in full and answer-metric modes, with its agreement check
   (exact in float32; in bfloat16 the batched forwards round differently, so the answer metrics to ``BATCHED_RTOL``,
   and the held-out loss, which bfloat16 measures to a few percent on either path, not at all).
4. **out of memory**: a trial worker's batch run with the device's memory filled: its trials come back failed, the
   process survives and the next batch finishes. On the CPU (``--tiny``) the out-of-memory error is raised by the
   evaluation instead (emulated: a CPU has no device memory to fill).

Exits non-zero if a parity check fails, the engine's results differ (beyond a half-precision model's rounding:
``sweep_throughput.BATCHED_RTOL``), or the out-of-memory batch does not behave; a bar that does not hold is a
measurement, reported in the bars section, not a failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.gpu_measure import Report
from benchmarks.gpu_prefill import COMPRESSION_RATIO, STRATIFIED_M, check_bars, prefill_costs, row_spec
from benchmarks.sweep_throughput import BATCHED_RTOL, both_paths, fixed_trials
from grkv_core.catalog import QUERY_POLICIES
from grkv_core.config import EvalConfig, PressConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.models import LoadedModel
from grkv_core.models.tiny import byte_level_chatml_tokenizer
from grkv_core.options import GRKV_PRESETS
from grkv_core.solver import grkv_merge
from grkv_core.solver.capture import CAPTURED_SOLVES
from grkv_core.solver.reference import grkv_merge_reference

# Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B): what the paper times on an A100.
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)
PARITY_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
# A graph replay against the eager solve (largest absolute difference): the same kernels on a padded budget, so float
# rounding of sums over the padding's zeros, and a bfloat16 cache's last bit.
REPLAY_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def parity(report: Report, device: torch.device, tiny: bool) -> None:
    """Section 1: the solver on ``device`` against the float64 reference, float32 and with a bfloat16 cache."""
    batch, heads, rows, length, budget, dim = (1, 2, 8, 64, 16, 16) if tiny else (1, 2, 32, 512, 64, 128)
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(batch, heads, rows, dim, generator=generator)
    keys, values = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(2))
    kept = torch.stack([torch.randperm(length, generator=generator)[:budget] for _ in range(heads)])[None]
    fixed = torch.rand(batch, heads, budget, generator=generator) < 0.25
    positions = torch.arange(length - rows, length)
    options = dict(lambda_k=0.05, lambda_v=1e-2, steps=2, query_positions=positions)
    for dtype in (torch.float32, torch.bfloat16):
        cache = [tensor.to(dtype) for tensor in (keys, values)]

        def merged_on_device():
            return grkv_merge(
                queries.to(device),
                *(tensor.to(device) for tensor in cache),
                kept.to(device),
                fixed.to(device),
                cg_max_iter=400,
                cg_rtol=1e-7,
                **{**options, "query_positions": positions.to(device)},
            )

        fast = merged_on_device()
        CAPTURED_SOLVES.enabled = False
        eager = merged_on_device()
        CAPTURED_SOLVES.enabled = True
        reference = grkv_merge_reference(
            queries.double(), *(tensor.double() for tensor in cache), kept, fixed, **options
        )
        errors = []
        for result, expected, full in zip(fast, reference, cache):
            start = full.double().gather(2, kept[..., None].expand(-1, -1, -1, dim))
            errors.append(float((result.double().cpu() - expected).norm() / (expected - start).norm()))
        name = str(dtype).removeprefix("torch.")
        error = max(errors)
        passed = error < PARITY_TOLERANCE[name]
        # NOTE: on CUDA ``fast`` replayed a captured graph of the solve (``solver.capture``), ``eager`` did not.
        replay_difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fast, eager))
        passed = passed and replay_difference <= REPLAY_TOLERANCE[name]
        report.add(
            "parity",
            {
                "cache dtype": name,
                "key error": errors[0],
                "value error": errors[1],
                "tolerance": PARITY_TOLERANCE[name],
                "graph vs eager": replay_difference,
                "passed": passed,
            },
        )
        if not passed:
            report.problems.append(
                f"parity in {name}: relative error {error:.3g}, graph vs eager {replay_difference:.3g}"
            )


def random_model(device: torch.device, tiny: bool, attention: str) -> LoadedModel:
    """A Llama-3.1-8B-shaped (or tiny) model with seeded random weights, bfloat16 on a GPU, float32 on the CPU."""
    tokenizer = byte_level_chatml_tokenizer(4096)
    shape = dict(TINY if tiny else LLAMA_8B)
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    return LoadedModel.of(model, tokenizer, "llama-3.1-8b-shape" if not tiny else "tiny-llama-shape")


def trial_engine(report: Report, loaded: LoadedModel, context: int, samples_per_task: int, trials: int) -> None:
    """Section 3: every trial with its own prefill against the engine's one prefill per sample (the same results:
    exactly in float32, to the format's precision in bfloat16)."""
    rows = load_dataset_samples(
        "ruler",
        tasks=("niah_single_1", "niah_multivalue"),
        context_length=context,
        samples_per_task=samples_per_task,
        seed=0,
        tokenizer=loaded.tokenizer,
    )
    chosen = fixed_trials("snapkv", COMPRESSION_RATIO, 0.88)[:trials]
    evaluator = Evaluator(loaded)
    rtol = BATCHED_RTOL.get(loaded.dtype)
    for mode in ("full", "answer"):
        seconds = {"per trial": 0.0, "engine": 0.0}
        problems, largest = [], 0.0
        for sample in rows:
            per_trial, engine, found, difference = both_paths(evaluator, sample, chosen, mode)
            seconds["per trial"] += per_trial
            seconds["engine"] += engine
            problems += found
            largest = max(largest, difference)
        report.add(
            "trial engine",
            {
                "mode": mode,
                "context": context,
                "samples": len(rows),
                "trials": len(chosen),
                "per-trial s": seconds["per trial"],
                "engine s": seconds["engine"],
                "speed-up": seconds["per trial"] / seconds["engine"],
                "agree": not problems,
                "tolerance": "exact" if rtol is None else f"relative {rtol:.2g}, decoded not compared",
                "largest answer difference": largest,
            },
        )
        report.problems += [f"trial engine ({mode}): {problem}" for problem in problems[:5]]


def out_of_memory(report: Report, device: torch.device) -> None:
    """Section 4: a worker's batch fails its trials when the device is out of memory, and the worker lives on."""
    from workers.protocol import TrialRequest
    from workers.trial_worker import TrialWorker

    config = EvalConfig(
        model="tiny-llama", tasks=("niah_single_1",), context_length=512, samples=1, dtype="float32", device=device.type
    )
    worker = TrialWorker(config.to_dict())
    requests = [
        TrialRequest(number, PressConfig("snapkv", 0.75, "grkv", {"lambda_k": 0.1 * (number + 1)}))
        for number in range(2)
    ]
    ballast = []
    if device.type == "cuda":
        # NOTE: one allocation of all the free memory fails (the allocator's rounding and context need some of it),
        # and blocks the allocator caches (an earlier section's model) would still serve the worker: so the cache is
        # emptied and the ballast taken in halving chunks, down to the small pool's sizes, until nothing fits
        torch.cuda.empty_cache()
        chunk = torch.cuda.mem_get_info(device)[0]
        while chunk >= 512:
            try:
                ballast.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            except torch.cuda.OutOfMemoryError:
                chunk //= 2
        how = "device memory filled"
    else:
        original = worker.setup.evaluator.evaluate_trials

        def ballast_raise(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (emulated on the CPU)")

        worker.setup.evaluator.evaluate_trials = ballast_raise
        how = "OutOfMemoryError raised by the evaluation (emulated)"
    failed = worker.evaluate_batch(requests)
    if device.type == "cuda":
        ballast.clear()
        torch.cuda.empty_cache()
    else:
        worker.setup.evaluator.evaluate_trials = original
    recovered = worker.evaluate_batch(
        [TrialRequest(number + 2, request.press) for number, request in enumerate(requests)]
    )
    behaved = all(not outcome.ok and "out of memory" in outcome.error for outcome in failed) and all(
        outcome.ok for outcome in recovered
    )
    report.add(
        "out of memory",
        {
            "how": how,
            "failed trials": sum(not o.ok for o in failed),
            "errors": failed[0].error.split(":")[0] if failed[0].error else "",
            "next batch ok": sum(o.ok for o in recovered),
            "as expected": behaved,
        },
    )
    if not behaved:
        report.problems.append("out-of-memory batch: " + "; ".join(str(o.error) for o in failed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: every section in seconds (the test suite)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default 4K 16K 32K (tiny: 256)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 (tiny: 1 2)")
    parser.add_argument(
        "--rows",
        type=row_spec,
        nargs="+",
        default=None,
        metavar="CONTEXTxBATCH",
        help="the prefill rows, e.g. 4096x1 32768x1 4096x4 (instead of every context at every batch)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after a warm-up (default 5; tiny 1)")
    parser.add_argument(
        "--synced-rounds", type=int, default=None, help="rounds of the instrumented pass (default 3; tiny 1)"
    )
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument(
        "--engine-trials", type=int, default=None, help="trials of the trial-engine section (default 16; tiny 2)"
    )
    timed = f"the surrogate-query policies timed at m={STRATIFIED_M} (none: give the flag alone)"
    parser.add_argument(
        "--query-policies", nargs="*", default=["stratified"], choices=tuple(QUERY_POLICIES), help=timed
    )
    parser.add_argument("--presets", nargs="+", default=[], choices=sorted(GRKV_PRESETS), help="GRKV's presets timed")
    parser.add_argument("--prefill-only", action="store_true", help="parity and prefill only (no engine, no OOM)")
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for the CPU path)")
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    if device.type == "cuda":
        # NOTE: seen on an H200: a fresh process whose first CUDA call was a batched Cholesky hit a MAGMA assertion.
        torch.backends.cuda.preferred_linalg_library("cusolver")
    if args.rows and (args.contexts or args.batches):
        parser.error("--rows names every row: give it without --contexts and --batches")
    contexts = args.contexts or ([256] if args.tiny else [4096, 16384, 32768])
    batches = args.batches or ([1, 2] if args.tiny else [1, 4])
    rows = args.rows or [(context, batch) for context in contexts for batch in batches]
    rounds = args.rounds or (1 if args.tiny else 5)
    synced_rounds = args.synced_rounds or (1 if args.tiny else 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    attentions = ["sdpa"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        attentions.append("flash_attention_2")
    versions = {package.__name__: package.__version__ for package in (torch, transformers)}
    report = Report(
        name,
        {
            "device": str(device),
            "tiny": args.tiny,
            "rows": rows,
            "rounds": rounds,
            "synced rounds": synced_rounds,
            "attentions": attentions,
            "versions": versions,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
        },
    )
    print(f"GRKV GPU check on {name}: {json.dumps(report.settings)}", flush=True)
    parity(report, device, args.tiny)
    for attention in attentions:
        loaded = random_model(device, args.tiny, attention)
        prefill_costs(
            report, loaded, rows, rounds, synced_rounds, args.decode_tokens, args.query_policies, args.presets
        )
        if attention == "sdpa" and not args.prefill_only:
            # NOTE: a RULER prompt needs ~400 byte-level tokens besides its haystack
            trial_engine(
                report,
                loaded,
                max(rows[0][0], 1024),
                samples_per_task=1 if args.tiny else 2,
                trials=args.engine_trials or (2 if args.tiny else 16),
            )
        del loaded
    if not args.prefill_only:
        out_of_memory(report, device)
    check_bars(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    result = {**report.settings, "device_name": name, "sections": report.sections, "problems": report.problems}
    (args.output_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (args.output_dir / "gpu_check.md").write_text(report.markdown())
    print(f"problems: {'; '.join(report.problems) if report.problems else 'none'}")
    print(f"report: {args.output_dir / 'gpu_check.md'}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
