"""Merge quality on real caches, loss only: many GRKV configurations replayed on the same recorded problems.

    python -m benchmarks.merge_quality --samples 2
    python -m benchmarks.merge_quality --model tiny-llama --context-length 512 --samples 2

For each offline RULER sample the context is prefilled once under SnapKV + GRKV with a press that records,
per layer, the merge problem exactly as ``GRKVPress`` hands it to ``grkv_merge`` (surrogate queries, full
cache, kept and fixed rows, the target from the forward). A second, uncompressed forward over context +
first question + its reference answer (teacher-forced) gives each layer's queries of those question and
answer tokens: the queries the compressed cache must serve next. Every configuration below is then solved on
the recorded problems and scored by

- the window discrepancy Σ‖Y_full − Y_comp‖² / Σ‖Y_full‖² on the surrogate window (what GRKV minimises);
- the held-out discrepancy on the question/answer queries, attention restricted to the context's cache;
- the share of (layer, head) units whose window loss ends above the value step's (GRV) alone;
- for safeguarded configurations, the key-step length each head kept (1, 1/2, ..., or 0 = value step's keys).

No decoding: the script measures reconstruction, not task scores (``grkv compare`` measures those).
"""

from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

import torch
import transformers

from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.generation import prefill, tokenize_sample
from grkv_core.models import load_model
from grkv_core.options import GRKV_DEFAULTS
from grkv_core.presses.from_config import build_press
from grkv_core.presses.grkv import GRKVPress
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.solver import grkv_merge
from grkv_core.solver.losses import discrepancy_per_head


@dataclass
class Problem:
    """One layer's merge as GRKVPress runs it; shapes as ``grkv_merge`` takes them."""

    queries: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    kept: torch.Tensor
    fixed: torch.Tensor
    scale: float
    target: torch.Tensor | None
    heldout_queries: torch.Tensor | None = None


class RecordingGRKVPress(GRKVPress):
    """GRKVPress that records every layer's merge problem and keeps the plain evicted rows."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.problems: list[Problem] = []

    def merge_selected(self, keys, values, selection, context):
        # NOTE: the same kept and fixed sets GRKVPress.merge_selected hands grkv_merge (uniform SnapKV budget).
        kept = selection.kept_positions()
        self.problems.append(
            Problem(
                context.surrogate.queries,
                context.surrogate.positions,
                keys,
                values,
                kept,
                self._fixed(kept, selection.scores.gather(-1, kept), keys.shape[2]),
                context.scale,
                context.full_outputs,
            )
        )
        index = kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, index), values.gather(2, index)


# NOTE: options left out take grkv_merge's defaults (GRKV_DEFAULTS: λ = 1e-2, safeguard on, the CG budget below).
DEFAULT_CG = GRKV_DEFAULTS["cg_max_iter"]
CONFIGS: dict[str, dict | None] = {
    "snapkv (evicted)": None,
    "grv (values only)": dict(components="v"),
    "grkv paper (no safeguard, cg 16)": dict(safeguard=False, cg_max_iter=16),
    f"grkv paper, cg {DEFAULT_CG} (the default budget)": dict(safeguard=False),
    "grkv paper, cg converged": dict(safeguard=False, cg_max_iter=200, cg_rtol=1e-7),
    "grkv safeguard, cg 16": dict(cg_max_iter=16),
    "grkv safeguard, cg 8": dict(cg_max_iter=8),
    "grkv safeguard, cg 6": dict(cg_max_iter=6),
    "grkv safeguard, cg 4": dict(cg_max_iter=4),
    "grkv safeguard, cg 3": dict(cg_max_iter=3),
    "grkv safeguard, cg 2": dict(cg_max_iter=2),
    "grkv safeguard, cg 1": dict(cg_max_iter=1),
    "grkv safeguard, cg converged": dict(cg_max_iter=200, cg_rtol=1e-7),
    "grkv paper, λ_k=0": dict(safeguard=False, lambda_k=0.0),
    "grkv safeguard, λ_k=0": dict(lambda_k=0.0),
}
for _lam in (1e-2, 1e-1, 1.0):
    for _scale in ("absolute", "relative"):
        CONFIGS[f"grkv safeguard, λ={_lam:g} {_scale}"] = dict(lambda_k=_lam, lambda_v=_lam, ridge_scale=_scale)
        CONFIGS[f"grv, λ={_lam:g} {_scale}"] = dict(lambda_v=_lam, ridge_scale=_scale, components="v")


def record_problems(loaded, sample, compression_ratio: float) -> list[Problem]:
    context_ids, question_ids = tokenize_sample(loaded.tokenizer, sample)
    press = RecordingGRKVPress(press=build_press("snapkv", compression_ratio))
    prefill(loaded.model, context_ids, press)
    answer = loaded.tokenizer.encode(" " + ", ".join(sample.references[0]), add_special_tokens=False)
    continuation = torch.cat([question_ids[0], torch.tensor([answer])], dim=1)
    captured = {}

    def keep_queries(module, _args, kwargs, _output):
        hidden = kwargs["hidden_states"][:, context_ids.shape[1] :]
        cos, sin = kwargs["position_embeddings"]
        embeddings = (cos[:, context_ids.shape[1] :], sin[:, context_ids.shape[1] :])
        captured[module.layer_idx] = surrogate_queries(module, hidden, embeddings, n_queries=hidden.shape[1]).queries

    handles = [
        layer.self_attn.register_forward_hook(keep_queries, with_kwargs=True) for layer in loaded.model.model.layers
    ]
    try:
        with torch.inference_mode():
            loaded.model.model(input_ids=torch.cat([context_ids, continuation], dim=1))
    finally:
        for handle in handles:
            handle.remove()
    for index, problem in enumerate(press.problems):
        problem.heldout_queries = captured[index]
    return press.problems


def solve(problem: Problem, options: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    if options is None:
        index = problem.kept.unsqueeze(-1).expand(-1, -1, -1, problem.keys.shape[-1])
        return problem.keys.gather(2, index), problem.values.gather(2, index)
    return grkv_merge(
        problem.queries,
        problem.keys,
        problem.values,
        problem.kept,
        problem.fixed,
        query_positions=problem.positions,
        scale=problem.scale,
        full_outputs=problem.target,
        **{"lambda_k": 1e-2, "lambda_v": 1e-2, **options},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue"]
    )
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--compression-ratio", type=float, default=0.9)
    parser.add_argument("--only", nargs="*", default=None, help="configuration names to run (default: all)")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    loaded = load_model(args.model, dtype="float32")
    samples = load_dataset_samples(
        "ruler",
        tasks=args.tasks,
        samples_per_task=args.samples,
        seed=args.seed,
        tokenizer=loaded.tokenizer,
        context_length=args.context_length,
    )
    configs = {
        name: options
        for name, options in CONFIGS.items()
        if args.only is None or name in args.only or options is None or name.startswith("grv (")
    }
    sums = collections.defaultdict(float)
    lengths = collections.defaultdict(collections.Counter)
    units = 0
    for sample_number, sample in enumerate(samples, 1):
        for problem in record_problems(loaded, sample, args.compression_ratio):
            results = {name: solve(problem, options) for name, options in configs.items()}
            window_args = dict(
                query_positions=problem.positions,
                compressed_positions=problem.kept,
                scale=problem.scale,
                full_outputs=problem.target,
            )
            errors = {}
            for name, (keys, values) in results.items():
                error, reference = discrepancy_per_head(
                    problem.queries, problem.keys, problem.values, keys, values, **window_args
                )
                held, held_reference = discrepancy_per_head(
                    problem.heldout_queries, problem.keys, problem.values, keys, values, scale=problem.scale
                )
                errors[name] = error
                sums[name, "window"] += float(error.sum())
                sums[name, "heldout"] += float(held.sum())
            sums["reference", "window"] += float(reference.sum())
            sums["reference", "heldout"] += float(held_reference.sum())
            grv = errors["grv (values only)"]
            units += grv.numel()
            for name, error in errors.items():
                sums[name, "worse_than_grv"] += int((error > grv * (1 + 1e-5)).sum())
            # The safeguard's kept length per head, as the projection of its key update on the paper's.
            paper, guarded = "grkv paper (no safeguard, cg 16)", "grkv safeguard, cg 16"
            if paper in results and guarded in results:
                evicted_keys = results["snapkv (evicted)"][0].double()
                step = results[paper][0].double() - evicted_keys
                taken = results[guarded][0].double() - evicted_keys
                fraction = (taken * step).sum(dim=(-2, -1)) / (step * step).sum(dim=(-2, -1)).clamp_min(1e-30)
                for value in fraction.flatten().tolist():
                    lengths[guarded][0.0 if value < 1e-6 else 2.0 ** round(math.log2(value))] += 1
        print(f"sample {sample_number}/{len(samples)} ({sample.task}) done", flush=True)
    if not units:
        raise SystemExit("no merge problem was recorded: RecordingGRKVPress no longer intercepts GRKVPress's merge")

    print(
        f"\nmodel={args.model} samples={len(samples)} tasks={','.join(args.tasks)} context={args.context_length} "
        f"keep={1 - args.compression_ratio:.0%} (layer, head) units={units}"
    )
    print(f"{'configuration':40s} {'window':>9s} {'held-out':>9s} {'worse than GRV':>15s}")
    for name in configs:
        print(
            f"{name:40s} {sums[name, 'window'] / sums['reference', 'window']:9.5f} "
            f"{sums[name, 'heldout'] / sums['reference', 'heldout']:9.5f} "
            f"{int(sums[name, 'worse_than_grv']):8d} / {units}"
        )
    for name, counter in lengths.items():
        shares = ", ".join(f"{length:g}: {count}" for length, count in sorted(counter.items(), reverse=True))
        print(f"key-step length kept by the safeguard ({name}): {shares}")


if __name__ == "__main__":
    main()
