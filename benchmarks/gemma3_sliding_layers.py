"""Gemma 3 270M on offline RULER at 2K: SnapKV compressing every layer (what kvpress 0.5.5 does to a
Gemma3ForCausalLM, entered as ``press(model)``) against SnapKV on the global layers only (its sliding-window layers
left whole, as kvpress does for Gemma3ForConditionalGeneration and every evaluation here does for every model:
``grkv_core.presses.sliding_layers``), by the needle in each greedy answer.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.gemma3_sliding_layers --compression-ratio 0.8
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.generation import answer_question, prefill, stop_token_ids, tokenize_sample
from grkv_core.models import load_model
from grkv_core.presses.from_config import build_press


def prefill_as_kvpress(model, context_ids: torch.Tensor, press) -> DynamicCache:
    """kvpress's own treatment: ``press(model)`` as it is, every layer of a Gemma3ForCausalLM hooked."""
    cache = DynamicCache()
    with press(model), torch.inference_mode():
        model.model(input_ids=context_ids, past_key_values=cache)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression-ratio", type=float, default=0.8)
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    loaded = load_model("gemma3-270m")
    press = build_press("snapkv", args.compression_ratio)
    prefills = {
        "full": lambda ids: prefill(loaded.model, ids),
        "snapkv every layer": lambda ids: prefill_as_kvpress(loaded.model, ids, press),
        "snapkv global layers only": lambda ids: prefill(loaded.model, ids, press),
    }
    samples = load_dataset_samples(
        "ruler", tasks=args.tasks, context_length=2048, samples_per_task=args.samples, tokenizer=loaded.tokenizer
    )
    for sample in samples:
        context_ids, (question_ids,) = tokenize_sample(loaded.tokenizer, sample)
        for name, prefilled in prefills.items():
            cache = prefilled(context_ids)
            answer = answer_question(
                loaded.model, cache, question_ids, context_ids.shape[1], args.max_new_tokens, stop_token_ids(loaded)
            )
            text = loaded.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
            print(
                f"{sample.sample_id} | {name} | needle found: {sample.references[0][0] in text} | {text[:48]!r}",
                flush=True,
            )


if __name__ == "__main__":
    main()
