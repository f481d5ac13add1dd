"""Cost of GRKV's merge relative to one decoder layer's prefill, measured side by side in one run.

    python -m benchmarks.solver_cost              # SmolLM2-135M shapes, CPU, float32
    python -m benchmarks.solver_cost --preset llama-3.1-8b --device cuda --dtype bfloat16 --tokens 32768

Prints the median wall time (calls interleaved) of (a) one LlamaDecoderLayer forward over the whole prompt
(the prefill cost GRKV is added to), (b) the merge per layer as GRKVPress runs it at its defaults: each of
``--layers`` layers (``layers_per_solve``) reduced to its regression, handing over the window's full-cache
attention outputs that the layer's own forward computed (``full_outputs``), all of them stacked and solved in
one call, the total divided by ``--layers``, (c) grkv_merge on one layer standalone, computing those outputs
itself, (d) optionally the naive explicit-Jacobian implementation (grkv_core.solver.reference) on that layer,
and the ratios. Inputs are random (every layer its own): the cost of either computation does not depend on
their values.

CPU heap (``--heap``). The layer frees ~100 MB of activations per call. With glibc's default settings the
allocator may hand that memory back to the kernel inside whichever call frees a chunk next, often the merge:
``strace -T`` shows brk() calls shrinking the heap by 48-102 MiB in 3-6 ms each, in some processes and not
others, so the merge's time depends on the process. Hence three settings:
``release`` (default) returns freed memory to the kernel (malloc_trim) untimed before every timed call, so
each call pays for the memory it touches itself and for nothing another call freed; ``keep`` never returns
freed memory (mallopt), so every call reuses warm memory, as jemalloc or tcmalloc would; ``as-is`` is glibc's
defaults.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from grkv_core.options import GRKV_DEFAULTS, SolverOptions
from grkv_core.solver import grkv_merge
from grkv_core.solver.merge import solve_regression
from grkv_core.solver.reference import grkv_merge_reference
from grkv_core.solver.regression import KeptRegression


@dataclass(frozen=True)
class LayerShape:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int


PRESETS = {
    "smollm2-135m": LayerShape(576, 9, 3, 64, 1536, 30),
    "llama-3.1-8b": LayerShape(4096, 32, 8, 128, 14336, 32),
}


HEAP_SETTINGS = ("release", "keep", "as-is")
# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit machines.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def heap_preparation(setting: str, device: torch.device):
    """Apply the ``--heap`` setting; return the untimed call to make before every timed call (or None)."""
    if setting == "as-is" or device.type != "cpu":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        raise SystemExit(f"--heap {setting} needs glibc (malloc_trim/mallopt); use --heap as-is on this system")
    if setting == "keep":
        if not (libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)):
            raise SystemExit("mallopt refused the --heap keep settings")
        return None
    return lambda: libc.malloc_trim(0)


def interleaved_median_seconds(
    functions, repeats: int, device: torch.device, warmup: int = 3, before_each=None
) -> list[float]:
    """Median wall time of each function, calling them in turn on every repeat.

    Alternating the calls exposes both to the same background load, so their ratio stays stable on a
    shared machine even when the absolute times drift. ``warmup`` untimed rounds come first: a new shape's
    first calls pay for kernel selection and allocator growth (on the CPU the merge stayed ~40% slower for
    its first few calls), which a prefill pays once, not once per layer. ``before_each`` runs untimed
    before every timed call.
    """
    for _ in range(warmup):
        for function in functions:
            function()
    times = [[] for _ in functions]
    for _ in range(repeats):
        for function, samples in zip(functions, times):
            if before_each is not None:
                before_each()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            function()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.10, help="fraction of the cache kept")
    parser.add_argument("--window", type=int, default=32, help="surrogate query tokens m")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--cg-max-iter", type=int, default=GRKV_DEFAULTS["cg_max_iter"], help="GRKVPress's default")
    parser.add_argument(
        "--layers",
        type=int,
        default=GRKV_DEFAULTS["layers_per_solve"],
        help="layers solved together (layers_per_solve; GRKVPress's default; 0: the model's every layer)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--heap",
        choices=HEAP_SETTINGS,
        default="release",
        help="CPU heap handling between timed calls (see the module docstring)",
    )
    parser.add_argument(
        "--naive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the explicit-Jacobian reference (slow, large memory)",
    )
    parser.add_argument(
        "--naive-limit-gib",
        type=float,
        default=4.0,
        help="skip the naive reference when one head's explicit Jacobian would exceed this",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    before_each = heap_preparation(args.heap, device)
    dtype = getattr(torch, args.dtype)
    shape = PRESETS[args.preset]
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max(args.tokens, 8192),
        num_hidden_layers=1,
        attn_implementation="sdpa",
    )
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype).eval()
    rotary = LlamaRotaryEmbedding(config).to(device)
    hidden = torch.randn(1, args.tokens, shape.hidden_size, device=device, dtype=dtype)
    positions = torch.arange(args.tokens, device=device)[None]
    position_embeddings = tuple(t.to(dtype) for t in rotary(hidden, positions))

    def layer_prefill():
        with torch.inference_mode():
            layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)

    kv_heads, head_dim = shape.num_key_value_heads, shape.head_dim
    groups = shape.num_attention_heads // kv_heads
    budget = int(args.tokens * args.keep)
    m = args.window
    layers = args.layers or shape.num_layers
    # NOTE: one batch row per layer: row l holds layer l's cache, queries and fixed rows.
    keys = torch.randn(layers, kv_heads, args.tokens, head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    queries = torch.randn(layers, kv_heads, groups * m, head_dim, device=device, dtype=dtype)
    # Kept set as the press builds it: sinks + the recent window + the rest spread over the context.
    recent = torch.arange(args.tokens - m, args.tokens, device=device)
    middle = torch.randperm(args.tokens - m - 4, device=device)[: budget - m - 4] + 4
    kept = torch.cat([torch.arange(4, device=device), middle.sort().values, recent]).expand(layers, kv_heads, budget)
    kept = kept.contiguous()
    fixed = (kept < 4) | (kept >= args.tokens - m)
    fixed = fixed | (torch.rand(fixed.shape, device=device) < 0.1)
    query_positions = recent.repeat(groups)
    solve_args = dict(steps=args.steps, cg_max_iter=args.cg_max_iter)
    # NOTE: in GRKVPress these come out of the layer's prefill forward (the input of o_proj), whose cost is
    # the denominator; here they are computed once, untimed, in the model's dtype.
    visible = torch.arange(args.tokens, device=device)[None, :] <= query_positions[:, None]
    window_outputs = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=visible)

    def stacked_regression():
        return KeptRegression.stack(
            [
                KeptRegression.of(
                    queries[row],
                    keys[row],
                    values[row],
                    kept[row],
                    fixed[row],
                    query_positions=query_positions,
                    full_outputs=window_outputs[row],
                )
                for row in (slice(layer, layer + 1) for layer in range(layers))
            ]
        )

    def merge_in_press():
        solve_regression(stacked_regression(), SolverOptions(**solve_args))

    def merge_in_press_unguarded():
        solve_regression(stacked_regression(), SolverOptions(safeguard=False, **solve_args))

    def merge_standalone():
        grkv_merge(
            queries[:1], keys[:1], values[:1], kept[:1], fixed[:1], query_positions=query_positions, **solve_args
        )

    layer_seconds, group_seconds, unguarded_group_seconds, standalone_seconds = interleaved_median_seconds(
        [layer_prefill, merge_in_press, merge_in_press_unguarded, merge_standalone],
        args.repeats,
        device,
        before_each=before_each,
    )
    merge_seconds, unguarded_seconds = group_seconds / layers, unguarded_group_seconds / layers
    rows = [
        ("decoder layer prefill", layer_seconds, 1.0),
        ("merge per layer as GRKVPress runs it", merge_seconds, merge_seconds / layer_seconds),
        ("  same, safeguard=False", unguarded_seconds, unguarded_seconds / layer_seconds),
        ("grkv_merge of one layer standalone", standalone_seconds, standalone_seconds / layer_seconds),
    ]
    # NOTE: the reference forms each head's (M·d) × (F·d) Jacobian in float32, F = its free rows.
    jacobian_gib = groups * m * head_dim * int((~fixed[:1]).sum(dim=-1).max()) * head_dim * 4 / 2**30
    run_naive = args.naive and jacobian_gib <= args.naive_limit_gib
    if args.naive and not run_naive:
        print(
            f"naive reference skipped: one head's explicit Jacobian would take {jacobian_gib:.1f} GiB "
            f"(--naive-limit-gib {args.naive_limit_gib:g})"
        )
    if run_naive:
        naive_inputs = [t[:1].float().cpu() for t in (queries, keys, values)]

        def naive():
            grkv_merge_reference(
                *naive_inputs,
                kept[:1].cpu(),
                fixed[:1].cpu(),
                dtype=torch.float32,
                steps=args.steps,
                query_positions=query_positions.cpu(),
                safeguard=False,
            )

        (naive_seconds,) = interleaved_median_seconds([naive], 1, torch.device("cpu"), warmup=1)
        rows.append(("naive explicit Jacobian (CPU)", naive_seconds, naive_seconds / layer_seconds))

    print(
        f"preset={args.preset} tokens={args.tokens} kept={budget} ({args.keep:.0%}) m={m} groups={groups} "
        f"M={groups * m} kv_heads={kv_heads} d={head_dim} steps={args.steps} layers_per_solve={layers} "
        f"device={device} dtype={args.dtype} "
        f"threads={torch.get_num_threads()} heap={args.heap if device.type == 'cpu' else 'n/a'}"
    )
    print(f"{'what':36s} {'median ms':>10s} {'/ layer prefill':>16s}")
    for name, seconds, ratio in rows:
        print(f"{name:36s} {seconds * 1e3:10.2f} {ratio:16.2%}")
    print(
        f"the safeguard's share of the merge as GRKVPress runs it: "
        f"{(merge_seconds - unguarded_seconds) / merge_seconds:.1%} "
        f"({(merge_seconds - unguarded_seconds) * 1e3:.2f} ms, {args.cg_max_iter} CG iterations)"
    )
    if run_naive:
        # NOTE: against the standalone merge, which, like the naive one, computes the full-cache outputs.
        print(f"speed-up of grkv_merge over the naive implementation: {naive_seconds / standalone_seconds:.1f}x")


if __name__ == "__main__":
    main()
