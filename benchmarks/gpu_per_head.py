"""The per-head cache on a GPU (issue #60's note): decoding over each head's kept rows against kvpress's masked layout.

    python -m benchmarks.gpu_per_head --device cuda --output-dir $OUT/per-head        # Llama-3.1-8B's shape, 32K x 1
    python -m benchmarks.gpu_per_head --device cpu --tiny --output-dir /tmp/per-head  # the same code on tiny shapes

``gpu_check``'s random Llama-3.1-8B-shaped model (bfloat16, sdpa) prefills ``--context`` tokens under AdaKV at 10%
once per layout: ``masked`` (kvpress's: every row kept, the evicted ones hidden from attention) and ``per-head``
(``PerHeadCachePress``: each head's kept rows only). From that cache, ``--rounds`` rounds of ``--decode-tokens``
greedy steps (the appended rows cropped after each), timed with CUDA events and one synchronisation after the last
round; the first round is a warm-up. Per layout: the median ms per token, the cache's bytes, the peak memory allocated
and reserved while decoding, the attention path that served it (flash-attn's variable-length kernel where importable
in half precision, else the reference path), and, from one profiled step apart, the kernels and kernel ms per token.
Beside them the ratios per-head / masked, and how many of the greedy tokens the layouts share (bfloat16 rounds the two
attentions differently, so a token may differ). Written to ``per_head.json`` and ``per_head.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from benchmarks.gpu_check import random_model
from benchmarks.gpu_measure import Marks, Report
from grkv_core.cache.per_head_attention import _flash_varlen
from grkv_core.evaluation.generation import prefill
from grkv_core.presses.from_config import build_press
from grkv_core.presses.per_head_cache import PerHeadCachePress

COMPRESSION_RATIO = 0.9
LAYOUTS = ("masked", "per-head")
RATIOS = ("ms_per_token", "kv_MiB", "peak_allocated_GiB", "peak_reserved_GiB")


def layout_press(layout: str):
    press = build_press("adakv", COMPRESSION_RATIO)
    return PerHeadCachePress(press) if layout == "per-head" else press


def decode(model, cache, token: torch.Tensor, start: int, steps: int) -> list[torch.Tensor]:
    """``steps`` greedy tokens from ``token`` at stream position ``start``; the tokens as device tensors (no read)."""
    tokens = []
    for position in range(start, start + steps):
        position_ids = torch.full((1, 1), position, device=token.device)
        logits = model(input_ids=token, past_key_values=cache, position_ids=position_ids).logits
        token = logits[:, -1:].argmax(-1)
        tokens.append(token)
    return tokens


def profiled_step(model, cache, token: torch.Tensor, start: int) -> tuple[int, float]:
    """(kernels, kernel ms) of one decode step under ``torch.profiler`` (zeros on the CPU)."""
    if not token.is_cuda:
        return 0, 0.0
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        decode(model, cache, token, start, 1)
        torch.cuda.synchronize()
    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(event.device_time_total for event in kernels) / 1000


def measure_layout(model, ids: torch.Tensor, layout: str, rounds: int, steps: int, marks: Marks) -> tuple[dict, list]:
    device = ids.device
    with torch.inference_mode():
        cache = prefill(model, ids, layout_press(layout))
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        first = ids[:, -1:]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        spans, tokens = [], []
        for _ in range(rounds + 1):
            start = marks.now()
            tokens = decode(model, cache, first, ids.shape[1], steps)
            spans.append((start, marks.now()))
            cache.crop(ids.shape[1])
        marks.synchronize()
        milliseconds = [marks.ms(*span) / steps for span in spans[1:]]  # NOTE: the first round warms up
        kernels, kernel_ms = profiled_step(model, cache, first, ids.shape[1])
    row = {
        "layout": layout,
        "ms_per_token": statistics.median(milliseconds),
        "kv_MiB": kv_bytes / 2**20,
        "attention": attention_path(layout, ids),
        "kernels_per_token": kernels,
        "kernel_ms_per_token": kernel_ms,
    }
    if device.type == "cuda":
        row["peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
    return row, [int(token) for token in torch.cat(tokens, dim=-1)[0]]


def attention_path(layout: str, ids: torch.Tensor) -> str:
    """What attends over the layout's cache (``grkv_core.cache.per_head_attention`` for the per-head one)."""
    if layout == "masked":
        return "sdpa"
    return "flash-attn varlen" if ids.is_cuda and _flash_varlen() is not None else "reference"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the test suite's check of the code path)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    loaded = random_model(device, args.tiny, "sdpa")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, loaded.model.config.vocab_size, (1, args.context), generator=generator).to(device)
    settings = {**vars(args), "output_dir": str(args.output_dir)}
    report = Report(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", settings=settings)
    marks = Marks(device)
    rows, tokens = {}, {}
    for layout in LAYOUTS:
        rows[layout], tokens[layout] = measure_layout(loaded.model, ids, layout, args.rounds, args.decode_tokens, marks)
        report.add("layouts", rows[layout])
    shared = sum(a == b for a, b in zip(tokens["masked"], tokens["per-head"]))
    ratios = {key: rows["per-head"][key] / rows["masked"][key] for key in RATIOS if key in rows["masked"]}
    report.add("per-head / masked", {**ratios, "same_greedy_tokens": f"{shared}/{len(tokens['masked'])}"})
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "per_head.json").write_text(json.dumps({"device": report.device, **report.sections}, indent=1))
    (args.output_dir / "per_head.md").write_text(report.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
