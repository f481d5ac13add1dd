"""What GRKV adds to a prefill, operation by operation: how many operations it dispatches, from where, and their
own CPU time, against the base press alone (the same essay prompt as ``prefill_cost.py``).

    python -m benchmarks.prefill_ops                                # SmolLM2-135M, SnapKV 10%
    python -m benchmarks.prefill_ops --option layers_per_solve=0
    python -m benchmarks.prefill_ops --preset window32              # the default until 2026-11-28

Counts come from a ``TorchDispatchMode`` over one prefill (each operation attributed to the nearest grkv_core or
kvpress function on the stack), with the host reads among them (``bool(t)``, ``t.item()``, ``torch.equal``: on a GPU,
synchronisations); times from ``torch.profiler`` over ``--rounds`` prefills (self CPU time per
operation, per prefill), with the CPU heap kept (``--heap``, as ``prefill_cost.py``). The model's own operations
are the same under both presses, so their time differences are noise; the operations GRKV adds are the rows whose
call counts differ.

Last, the floor that GRKV's linear algebra sets with its results unchanged: every matrix product and factorisation
the merge dispatched in that prefill (``LINEAR_ALGEBRA``: same shapes, same count) replayed alone on random inputs,
the median of ``--repeats`` timings each, summed, against the base press's median prefill time over ``--rounds``
untimed-by-the-profiler prefills; with their FLOPs (``torch.utils.flop_counter``). No change that keeps the merge's
arithmetic can make GRKV's added cost smaller than that share, on this machine.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.prefill_cost import add_prefill_arguments, essay_prompt
from benchmarks.solver_cost import heap_preparation
from grkv_core.evaluation.generation import prefill
from grkv_core.merger_flags import parse_merge_variant
from grkv_core.models import load_model
from grkv_core.options import GRKV_PRESETS
from grkv_core.presses.from_config import build_press

# The operations whose arithmetic grows with the problem (the rest are elementwise or bookkeeping).
LINEAR_ALGEBRA = (
    "bmm",
    "baddbmm",
    "mm",
    "addmm",
    "linalg_vecdot",
    "linalg_cholesky_ex",
    "cholesky_solve",
    "linalg_eigh",
)
# Where the merge's own operations come from (the model's run under grkv_core.evaluation.generation, the scoring
# under kvpress).
MERGE_CODE = ("grkv_core/presses/", "grkv_core/solver/")
# The operations that read a tensor's value on the host (``bool(t)``, ``int(t)``, ``t.item()``, ``torch.equal``, ...):
# on a GPU each waits for every kernel queued before it. ``tolist`` dispatches none: ``CountedOperations`` counts it.
HOST_READS = ("is_nonzero", "item", "_local_scalar_dense", "equal", "allclose", "nonzero", "masked_select")


class CountedOperations(TorchDispatchMode):
    """Counts every dispatched operation by the nearest grkv_core or kvpress function that called it, and the host
    reads (``HOST_READS``) among them, and keeps the merge's ``LINEAR_ALGEBRA`` calls (``MERGE_CODE``) (operation,
    arguments' shapes) for ``replayed_ms``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()
        self.linear_algebra: collections.Counter = collections.Counter()

    def __enter__(self):
        # NOTE: ``tensor.tolist()`` reads the tensor on the host without dispatching an operation: counted here.
        self._tolist = torch.Tensor.tolist
        counted = self

        def tolist(tensor):
            counted.host_reads[_name(_nearest_library_frame(sys._getframe(1)))] += 1
            return counted._tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = _nearest_library_frame(sys._getframe(1))
        caller = _name(frame)
        self.by_caller[caller] += 1
        if func.overloadpacket.__name__ in HOST_READS:
            self.host_reads[caller] += 1
        if (
            frame is not None
            and any(part in frame.f_code.co_filename for part in MERGE_CODE)
            and func.overloadpacket.__name__ in LINEAR_ALGEBRA
        ):
            shapes = tuple((tuple(arg.shape), arg.dtype) if isinstance(arg, torch.Tensor) else arg for arg in args)
            self.linear_algebra[(func, shapes, tuple(sorted((kwargs or {}).items())))] += 1
        return func(*args, **(kwargs or {}))


def _nearest_library_frame(frame):
    """The nearest grkv_core or kvpress frame on the stack from ``frame`` (None: the model's own code)."""
    while frame is not None and not any(part in frame.f_code.co_filename for part in ("grkv_core", "kvpress")):
        frame = frame.f_back
    return frame


def _name(frame) -> str:
    """A frame of ``_nearest_library_frame`` as "file.py:function" ("model": none)."""
    return "model" if frame is None else f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"


def replayed_ms(calls: collections.Counter, repeats: int) -> tuple[float, float]:
    """(ms, GFLOP) of ``CountedOperations.linear_algebra``'s calls, each replayed alone on random inputs of its
    shapes (median of ``repeats`` timings, times its count)."""
    total_ms = 0.0
    with FlopCounterMode(display=False) as flops:
        for (func, shapes, kwargs), count in calls.items():
            args = [_random_like(shape) for shape in shapes]
            for _ in range(count):
                func(*args, **dict(kwargs))
    for (func, shapes, kwargs), count in calls.items():
        args = [_random_like(shape) for shape in shapes]
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            func(*args, **dict(kwargs))
            timings.append(time.perf_counter() - start)
        total_ms += statistics.median(timings) * count * 1000
    return total_ms, flops.get_total_flops() / 1e9


def _random_like(shape):
    """A random tensor for a recorded (shape, dtype); factorisations get a symmetric positive definite batch."""
    if not (isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[1], torch.dtype)):
        return shape
    size, dtype = shape
    if dtype == torch.bool:
        return torch.ones(size, dtype=dtype)
    tensor = torch.randn(size, dtype=dtype)
    if len(size) >= 2 and size[-1] == size[-2]:
        tensor = tensor @ tensor.mT + size[-1] * torch.eye(size[-1], dtype=dtype)
    return tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prefill_arguments(parser, rounds=3)
    parser.add_argument("--option", default="", metavar="k=v,...", help="GRKV options, e.g. layers_per_solve=0")
    parser.add_argument("--preset", choices=sorted(GRKV_PRESETS), help="GRKV's options from a preset (--option wins)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=15, help="timings of each replayed linear-algebra call")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    loaded = load_model(args.model)
    before_each = heap_preparation(args.heap, loaded.model.device)
    ids = essay_prompt(loaded.tokenizer, args.tokens)
    _, merge, options = parse_merge_variant(f"grkv=grkv:{args.option}" if args.option else "grkv=grkv")
    options = {**(GRKV_PRESETS[args.preset] if args.preset else {}), **options}
    presses = {
        "base": build_press(args.press, args.compression_ratio),
        "grkv": build_press(args.press, args.compression_ratio, merge=merge, **options),
    }
    counts, host_reads, times, linear_algebra, prefill_s = {}, {}, {}, {}, {}
    for name, press in presses.items():
        prefill(loaded.model, ids, press)  # warm-up
        with CountedOperations() as counted:
            prefill(loaded.model, ids, press)
        counts[name], host_reads[name] = counted.by_caller, counted.host_reads
        linear_algebra[name] = counted.linear_algebra
        prefill_s[name] = statistics.median(
            _timed_prefill(loaded.model, ids, press, before_each) for _ in range(args.rounds)
        )
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(args.rounds):
                prefill(loaded.model, ids, press)
        times[name] = {
            event.key: (event.count / args.rounds, event.self_cpu_time_total / args.rounds / 1000)
            for event in profiled.key_averages()
        }
    print(
        f"model={args.model} tokens={args.tokens} press={args.press} keep={1 - args.compression_ratio:.0%} "
        f"grkv options={args.preset or ''}{'+' if args.preset and args.option else ''}{args.option or ''}"
        f"{'' if args.preset or args.option else 'defaults'} threads={torch.get_num_threads()} rounds={args.rounds}"
    )
    print(
        f"dispatched operations per prefill: base {counts['base'].total()}, +grkv {counts['grkv'].total()}; "
        f"host reads (GPU synchronisations) base {host_reads['base'].total()}, +grkv {host_reads['grkv'].total()}"
    )
    print("\nadded operations by caller (grkv - base)")
    added = counts["grkv"].copy()
    added.subtract(counts["base"])
    for caller, count in added.most_common(args.top):
        print(f"{count:8d}  {caller}")
    print("\nadded host reads by caller (grkv - base)")
    added = host_reads["grkv"].copy()
    added.subtract(host_reads["base"])
    for caller, count in added.most_common(args.top):
        print(f"{count:8d}  {caller}")
    print("\noperations whose calls GRKV adds: +calls and +self CPU ms per prefill")
    rows = []
    for key in set(times["base"]) | set(times["grkv"]):
        base_calls, base_ms = times["base"].get(key, (0, 0.0))
        grkv_calls, grkv_ms = times["grkv"].get(key, (0, 0.0))
        if grkv_calls != base_calls:
            rows.append((grkv_ms - base_ms, grkv_calls - base_calls, key))
    for extra_ms, extra_calls, key in sorted(rows, reverse=True)[: args.top]:
        print(f"{key[:44]:44s} {extra_calls:+8.0f} {extra_ms:+9.2f}")
    print(f"{'total':44s} {sum(row[1] for row in rows):+8.0f} {sum(row[0] for row in rows):+9.2f}")
    floor_ms, gflop = replayed_ms(linear_algebra["grkv"], args.repeats)
    base_ms = prefill_s["base"] * 1000
    print(
        f"\nGRKV's linear algebra: {sum(linear_algebra['grkv'].values())} calls, {gflop:.2f} GFLOP, replayed alone "
        f"{floor_ms:.1f} ms per prefill = {floor_ms / base_ms:.2%} of the base press's prefill ({base_ms:.0f} ms, "
        f"median of {args.rounds}); whole prefill with GRKV {prefill_s['grkv'] * 1000:.0f} ms "
        f"({prefill_s['grkv'] / prefill_s['base'] - 1:+.2%})"
    )


def _timed_prefill(model, ids: torch.Tensor, press, before_each=None) -> float:
    """One prefill's wall time; ``before_each`` (``heap_preparation``'s, or None) runs untimed first."""
    if before_each is not None:
        before_each()
    start = time.perf_counter()
    prefill(model, ids, press)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
