"""Gemma 3 270M on offline RULER at 2K: SnapKV compressing every layer (what kvpress 0.5.5 does to a
Gemma3ForCausalLM) against SnapKV on the global layers only (its sliding-window layers left whole, as kvpress does
for Gemma3ForConditionalGeneration), by the needle in each greedy answer.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/gemma3_sliding_layers.py --compression-ratio 0.8
"""

from __future__ import annotations

import argparse

from kvpress import PerLayerCompressionPress

from grkv_core.datasets import load_dataset_samples
from grkv_core.generation import answer_question, prefill, stop_token_ids, tokenize_sample
from grkv_core.models import load_model
from grkv_core.registry import build_press


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression-ratio", type=float, default=0.8)
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    loaded = load_model("gemma3-270m")
    sliding = [layer.self_attn.is_sliding for layer in loaded.model.model.layers]
    ratio = args.compression_ratio
    presses = {
        "full": None,
        "snapkv every layer": build_press("snapkv", ratio),
        "snapkv global layers only": PerLayerCompressionPress(build_press("snapkv", 0.0),
                                                              [0.0 if is_sliding else ratio for is_sliding in sliding]),
    }
    samples = load_dataset_samples("ruler", tasks=args.tasks, context_length=2048, samples_per_task=args.samples,
                                   tokenizer=loaded.tokenizer)
    for sample in samples:
        context_ids, (question_ids,) = tokenize_sample(loaded.tokenizer, sample)
        for name, press in presses.items():
            cache = prefill(loaded.model, context_ids, press)
            answer = answer_question(loaded.model, cache, question_ids, context_ids.shape[1], args.max_new_tokens,
                                     stop_token_ids(loaded))
            text = loaded.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
            print(f"{sample.sample_id} | {name} | needle found: {sample.references[0][0] in text} | {text[:48]!r}",
                  flush=True)


if __name__ == "__main__":
    main()
