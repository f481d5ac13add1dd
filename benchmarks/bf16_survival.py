"""How much of a GRKV update survives being stored in a bfloat16 cache.

    python -m benchmarks.bf16_survival --samples 2

GRKV solves in float32 and writes K⁰ + ΔK back in the cache's dtype. On a GPU the cache is usually bfloat16,
whose 8-bit mantissa spaces representable numbers 2⁻⁸·|x| apart: an update smaller than half that spacing
rounds back to K⁰ exactly. This script prefills offline RULER prompts with SmolLM2 in float32 under SnapKV +
GRKV, rounds each layer's evicted (K⁰, V⁰) and merged (K, V) caches to bfloat16, and reports, over the free
rows the merge refitted:

- the share of entries that moved in float32 (K ≠ K⁰) but round back to K⁰ in bfloat16;
- the share of the update's energy that survives, ‖bf16(K) − bf16(K⁰)‖ / ‖K − K⁰‖ (likewise for V);
- the window discrepancy of the merged cache in float32 and after bfloat16 rounding, against the evicted
  cache's, so the effect on what GRKV optimises is visible.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.generation import prefill, tokenize_sample
from grkv_core.models import load_model
from grkv_core.presses.from_config import build_press
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.solver.losses import discrepancy_per_head


def rows(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return tensor.gather(2, positions.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multikey_1"])
    parser.add_argument("--samples", type=int, default=1, help="samples per task")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--compression-ratio", type=float, default=0.9)
    parser.add_argument("--window-size", type=int, default=32)
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    loaded = load_model(args.model, dtype="float32")
    model = loaded.model
    samples = load_dataset_samples(
        "ruler",
        tasks=args.tasks,
        samples_per_task=args.samples,
        tokenizer=loaded.tokenizer,
        context_length=args.context_length,
    )
    totals = {
        name: 0.0
        for name in (
            "moved_k",
            "rounded_back_k",
            "moved_v",
            "rounded_back_v",
            "update_k",
            "kept_k",
            "update_v",
            "kept_v",
            "evicted",
            "merged",
            "merged_bf16",
            "ref",
        )
    }
    for sample in samples:
        context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
        captured = {}

        def keep_full_cache(module, _args, kwargs, _output):
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            window = surrogate_queries(
                module, kwargs["hidden_states"], kwargs["position_embeddings"], n_queries=args.window_size
            )
            captured[module.layer_idx] = (layer.keys, layer.values, window, module)

        # NOTE: registered before the press's hooks, so it sees each layer's full cache before the merge.
        handles = [
            layer.self_attn.register_forward_hook(keep_full_cache, with_kwargs=True) for layer in model.model.layers
        ]
        try:
            cache = prefill(model, context_ids, build_press("snapkv", args.compression_ratio, merge="grkv"))
        finally:
            for handle in handles:
                handle.remove()
        for index, merged_layer in enumerate(cache.layers):
            full_keys, full_values, window, module = captured[index]
            kept = module.kept_positions
            keys0, values0 = rows(full_keys, kept), rows(full_values, kept)
            keys, values = merged_layer.keys, merged_layer.values
            for name, start, merged in (("k", keys0, keys), ("v", values0, values)):
                moved = merged != start
                rounded_start, rounded = start.bfloat16(), merged.bfloat16()
                totals[f"moved_{name}"] += int(moved.sum())
                totals[f"rounded_back_{name}"] += int((moved & (rounded == rounded_start)).sum())
                totals[f"update_{name}"] += float((merged - start).square().sum())
                totals[f"kept_{name}"] += float((rounded.float() - rounded_start.float()).square().sum())
            loss = dict(
                query_positions=window.positions + (context_ids.shape[1] - args.window_size),
                compressed_positions=kept,
                scale=module.scaling,
            )
            for name, (k, v) in (
                ("evicted", (keys0, values0)),
                ("merged", (keys, values)),
                ("merged_bf16", (keys.bfloat16().float(), values.bfloat16().float())),
            ):
                error, reference = discrepancy_per_head(window.queries, full_keys, full_values, k, v, **loss)
                totals[name] += float(error.sum())
            totals["ref"] += float(reference.sum())
        print(f"{sample.sample_id}: {len(cache.layers)} layers measured")

    print(f"model={args.model} samples={len(samples)} keep={1 - args.compression_ratio:.0%} (SnapKV + GRKV defaults)")
    for name, label in (("k", "keys"), ("v", "values")):
        print(
            f"{label}: {totals[f'moved_{name}']:.0f} entries moved in float32; "
            f"{totals[f'rounded_back_{name}'] / max(totals[f'moved_{name}'], 1):.1%} of them round back to the "
            f"evicted value in bfloat16; update energy surviving bfloat16: "
            f"{(totals[f'kept_{name}'] / max(totals[f'update_{name}'], 1e-30)) ** 0.5:.1%} (norm ratio)"
        )
    for name in ("evicted", "merged", "merged_bf16"):
        print(f"window discrepancy, {name:12s}: {totals[name] / totals['ref']:.5f}")


if __name__ == "__main__":
    main()
