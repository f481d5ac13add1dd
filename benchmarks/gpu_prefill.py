"""``gpu_check.py``'s prefill section: SnapKV alone against SnapKV + GRKV, timed as a request meets them, then
instrumented apart; and issue #50's bars on what it measured.

Per row (a context × batch), in this order (``measure_row``):

1. **first request**: a SnapKV prefill (the model's first at the shape: not GRKV's cost), then the first GRKV
   prefill (defaults) of the fresh shape, in which ``CAPTURED_SOLVES`` captures its graphs, timed alone, against a
   warm one's TTFT; a line of its own. Every other press then prefills once, untimed (capturing its graphs).
2. a warm-up round, untimed: every press once, counting the operations and host reads it dispatches
   (``prefill_ops``).
3. **timed rounds**: every press in turn per round, between marks that never synchronise (``gpu_measure.Marks``:
   CUDA events on a GPU, the wall clock on the CPU): one before the prefill's call, one once the compressed cache is
   ready (**TTFT**) and one after a greedy decode step reading it (the **second token**). One
   ``torch.cuda.synchronize()`` after the last round, then the events are read; the allocator stays warm (its cache
   is never emptied). Medians over the rounds, their ratios to SnapKV alone's, and each press's peak allocated
   memory (its peak reset before each prefill: the allocator's host-side count, no synchronisation).
4. an instrumented pass, apart from the timed one: ``synced_rounds`` rounds with every compression hook timed
   between two synchronisations (``prefill_cost.timed_hook``: 2 × layers drains of the device's queue per prefill),
   for the merge's ms per layer (GRKV's hooks minus SnapKV's) and that prefill's ms and ratio (``synced TTFT ratio``:
   what the result pages of issue #43 call the TTFT ratio); one prefill per press with the allocator's cache emptied
   before it, for its peak reserved memory, and ``decode_tokens`` steps on it, each timed alone; ``torch.profiler``
   over one more prefill: the kernels, kernel ms and stream synchronisations GRKV adds per layer.
5. **memory** after the row: ``torch.cuda.memory_reserved()`` and the bytes CUDA graphs' pools hold
   (``CAPTURED_SOLVES``'s among them).

On the CPU the memory columns read "n/a (CPU)" and no graph is captured.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.gpu_measure import Marks, Report, Stopwatch, graph_pool_bytes, profiled_prefill
from benchmarks.prefill_cost import timed_hook
from benchmarks.prefill_ops import CountedOperations
from grkv_core.evaluation.generation import prefill, run_tokens
from grkv_core.models import LoadedModel
from grkv_core.options import GRKV_PRESETS
from grkv_core.presses.from_config import build_press
from grkv_core.solver.capture import CAPTURED_SOLVES

COMPRESSION_RATIO = 0.9  # SnapKV keeping 10%
STRATIFIED_M = 128  # the stratified policy's m in the prefill section (the research's best configuration's)
BASE, DEFAULTS = "snapkv", "snapkv+grkv"
NOT_MEASURED = "n/a (CPU)"
# Issue #50's bars: (column, press, (context, batch), bound). The ratios are to SnapKV alone's; "graph pools GiB" is
# the memory section's, after the row; "peak reserved GiB above SnapKV" is the press's peak reserved memory less
# SnapKV alone's. NOTE: the graph pools are live in both presses' peaks (GRKV's graphs outlive its prefill), so that
# difference is the merge's transient memory, and the pools have bars of their own.
BARS = (
    *(
        (column, DEFAULTS, row, bound)
        for column in ("TTFT ratio", "second token ratio")
        for row, bound in (((4096, 1), 1.05), ((32768, 1), 1.02), ((4096, 4), 1.08))
    ),
    ("TTFT ratio", f"{DEFAULTS} preset=window32", (4096, 1), 1.03),
    ("TTFT ratio", f"{DEFAULTS} preset=window32", (32768, 1), 1.01),
    *(("graph pools GiB", None, row, 2.0) for row in ((4096, 1), (32768, 1), (4096, 4))),
    ("peak reserved GiB above SnapKV", DEFAULTS, (32768, 1), 1.0),
)


def row_spec(text: str) -> tuple[int, int]:
    """``--rows``' ``CONTEXTxBATCH`` (``4096x1``) as (context, batch)."""
    context, _, batch = text.partition("x")
    try:
        return int(context), int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a row is CONTEXTxBATCH (4096x1), got {text!r}") from None


def build_presses(layers: int, query_policies: list[str], presets: list[str]) -> dict:
    """SnapKV alone, + GRKV's defaults, with ``layers_per_solve`` 1, with its solves on a side stream
    (``merge_stream="side"``: all layers in one solve, or in groups of 8, which the forward's later layers overlap),
    with each of ``query_policies`` (m = ``STRATIFIED_M``) and with each of ``presets`` (``GRKV_PRESETS``), by name."""
    presses = {
        BASE: build_press("snapkv", COMPRESSION_RATIO),
        DEFAULTS: build_press("snapkv", COMPRESSION_RATIO, merge="grkv"),
    }
    presses[f"{DEFAULTS} layers_per_solve=1"] = build_press(
        "snapkv", COMPRESSION_RATIO, merge="grkv", layers_per_solve=1
    )
    for per_solve in (0, min(8, layers)):
        presses[f"{DEFAULTS} side stream layers_per_solve={per_solve}"] = build_press(
            "snapkv", COMPRESSION_RATIO, merge="grkv", merge_stream="side", layers_per_solve=per_solve
        )
    for policy in query_policies:
        presses[f"{DEFAULTS} {policy} m={STRATIFIED_M}"] = build_press(
            "snapkv", COMPRESSION_RATIO, merge="grkv", query_policy=policy, window_size=STRATIFIED_M
        )
    for preset in presets:
        presses[f"{DEFAULTS} preset={preset}"] = build_press(
            "snapkv", COMPRESSION_RATIO, "grkv", **GRKV_PRESETS[preset]
        )
    return presses


def prefill_costs(
    report: Report, loaded: LoadedModel, rows: list[tuple[int, int]], rounds: int, synced_rounds: int,
    decode_tokens: int, query_policies: list[str], presets: list[str],
) -> None:  # fmt: skip
    """The prefill section at each (context, batch) of ``rows``: a row that runs out of memory says so and the next
    runs."""
    presses = build_presses(loaded.num_layers, query_policies, presets)
    for context, batch in rows:
        try:
            measure_row(report, loaded, presses, context, batch, rounds, synced_rounds, decode_tokens)
        except torch.cuda.OutOfMemoryError:
            report.add(
                "prefill",
                {
                    "context": context,
                    "batch": batch,
                    "attention": loaded.attn_implementation,
                    "press": "all",
                    "result": "out of memory",
                },
            )


def measure_row(
    report: Report, loaded: LoadedModel, presses: dict, context: int, batch: int, rounds: int, synced_rounds: int,
    decode_tokens: int,
) -> None:  # fmt: skip
    """One row's prefill rows (one per press), its first request and its memory (the module's steps 1-5)."""
    model, device = loaded.model, loaded.model.device
    layers = loaded.num_layers
    # NOTE: the prompt is on the device before any timing: a copy from the host's pageable memory can wait on the
    # device.
    ids = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(context + batch)).to(device)
    stopwatch = Stopwatch(device)
    first_ms, captured = first_request(model, ids, presses, stopwatch)
    counted = {}
    for name, press in presses.items():
        with CountedOperations() as counted[name]:
            prefill(model, ids, press)
    ttft, second, allocated = timed_rounds(model, ids, presses, rounds, Marks(device))
    synced, hook_seconds = synced_pass(model, ids, presses, synced_rounds, stopwatch)
    reserved, decode_ms = alone_pass(model, ids, presses, decode_tokens, stopwatch)
    profiled = {name: profiled_prefill(model, ids, press, device) for name, press in presses.items()}
    medians = {
        column: {name: statistics.median(times[name]) for name in presses}
        for column, times in (("TTFT", ttft), ("second token", second), ("synced", synced))
    }
    row = {"context": context, "batch": batch, "attention": loaded.attn_implementation}
    for name in presses:
        merge_ms = 1000 * (hook_seconds[name] - hook_seconds[BASE]) / synced_rounds / layers
        added_operations = (counted[name].by_caller.total() - counted[BASE].by_caller.total()) / layers
        added_host_reads = (counted[name].host_reads.total() - counted[BASE].host_reads.total()) / layers
        kernels, kernel_ms, synchronisations = (
            (profiled[name][index] - profiled[BASE][index]) / layers if device.type == "cuda" else NOT_MEASURED
            for index in range(3)
        )
        report.add(
            "prefill",
            {
                **row,
                "press": name,
                "TTFT ms": medians["TTFT"][name],
                "TTFT ratio": medians["TTFT"][name] / medians["TTFT"][BASE],
                "second token ms": medians["second token"][name],
                "second token ratio": medians["second token"][name] / medians["second token"][BASE],
                "synced prefill ms": medians["synced"][name],
                "synced TTFT ratio": medians["synced"][name] / medians["synced"][BASE],
                "merge ms/layer": merge_ms,
                "merge / layer prefill": merge_ms / (medians["synced"][BASE] / layers),
                "added ops/layer": added_operations,
                "added host reads/layer": added_host_reads,
                "added kernels/layer": kernels,
                "added kernel ms/layer": kernel_ms,
                "added stream syncs/layer": synchronisations,
                "merge µs/added op": 1000 * merge_ms / added_operations if added_operations else "",
                "peak allocated GiB": allocated.get(name, NOT_MEASURED),
                "peak reserved GiB": reserved.get(name, NOT_MEASURED),
                "decode ms/token": statistics.median(decode_ms[name]),
            },
        )
    warm = medians["TTFT"][DEFAULTS]
    report.add(
        "first request",
        {
            **row,
            "press": DEFAULTS,
            "first prefill ms": first_ms,
            "warm TTFT ms": warm,
            "first / warm": first_ms / warm,
            "graphs captured": captured,
        },
    )
    cuda = device.type == "cuda"
    report.add(
        "memory",
        {
            **row,
            "reserved GiB": torch.cuda.memory_reserved(device) / 2**30 if cuda else NOT_MEASURED,
            "graph pools GiB": graph_pool_bytes() / 2**30 if cuda else NOT_MEASURED,
            "CapturedSolves pool GiB": CAPTURED_SOLVES.pool_bytes() / 2**30 if cuda else NOT_MEASURED,
            "graphs captured so far": CAPTURED_SOLVES.captures,
        },
    )


def first_request(model, ids: torch.Tensor, presses: dict, stopwatch: Stopwatch) -> tuple[float, int]:
    """The first prefill of ``ids``' shape under GRKV's defaults, timed alone (ms), and how many graphs
    ``CAPTURED_SOLVES`` captured in it (none on the CPU, or where the shape is not fresh); SnapKV prefills before it,
    every other press after it."""
    prefill(model, ids, presses[BASE])
    captures, first_ms = CAPTURED_SOLVES.captures, []
    with stopwatch.timed(first_ms):
        prefill(model, ids, presses[DEFAULTS])
    captured = CAPTURED_SOLVES.captures - captures
    for name, press in presses.items():
        if name not in (BASE, DEFAULTS):
            prefill(model, ids, press)
    return first_ms[0], captured


def timed_rounds(model, ids: torch.Tensor, presses: dict, rounds: int, marks: Marks) -> tuple[dict, dict, dict]:
    """Per press, each round's TTFT and time to the second token (ms), and the peak allocated GiB over the rounds
    (none on the CPU).

    NOTE: nothing here synchronises the device (the marks are CUDA events, read after the one synchronisation at the
    end; the peaks are the allocator's host-side counts): the host queues work as far ahead as the code under test
    lets it, as it would serving requests."""
    spans = {name: [] for name in presses}
    allocated = {}
    token = ids[:, -1:]  # what the decode step feeds: its value does not change the step's cost
    for _ in range(rounds):
        for name, press in presses.items():
            if marks.cuda:
                torch.cuda.reset_peak_memory_stats(ids.device)
            start = marks.now()
            cache = prefill(model, ids, press)
            ready = marks.now()
            with torch.inference_mode():
                # the second token is chosen on the device: reading it here would synchronise
                run_tokens(model, cache, token, ids.shape[1]).argmax(-1)
            spans[name].append((start, ready, marks.now()))
            if marks.cuda:
                allocated[name] = max(allocated.get(name, 0.0), torch.cuda.max_memory_allocated(ids.device) / 2**30)
            del cache
    marks.synchronize()
    ttft = {name: [marks.ms(start, ready) for start, ready, _ in spans[name]] for name in presses}
    second = {name: [marks.ms(start, done) for start, _, done in spans[name]] for name in presses}
    return ttft, second, allocated


def synced_pass(model, ids: torch.Tensor, presses: dict, rounds: int, stopwatch: Stopwatch) -> tuple[dict, dict]:
    """Per press, each round's prefill (ms) with its compression hooks each timed between two synchronisations of the
    device, and those hooks' seconds summed over the rounds."""
    hooks = {name: [0.0] for name in presses}
    originals = {name: press.forward_hook for name, press in presses.items()}
    prefill_ms = {name: [] for name in presses}
    try:
        for name, press in presses.items():
            press.forward_hook = timed_hook(originals[name], hooks[name], stopwatch.cuda)
        for _ in range(rounds):
            for name, press in presses.items():
                with stopwatch.timed(prefill_ms[name]):
                    prefill(model, ids, press)
    finally:
        for name, press in presses.items():
            press.forward_hook = originals[name]
    return prefill_ms, {name: total[0] for name, total in hooks.items()}


def alone_pass(model, ids: torch.Tensor, presses: dict, decode_tokens: int, stopwatch: Stopwatch) -> tuple[dict, dict]:
    """Per press, one prefill with the allocator's cache emptied before it: its peak reserved GiB (none on the CPU),
    and ``decode_tokens`` greedy steps on its cache, each timed alone (ms)."""
    reserved, decode_ms = {}, {name: [] for name in presses}
    token = ids[:, -1:]
    for name, press in presses.items():
        if stopwatch.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ids.device)
        cache = prefill(model, ids, press)
        with torch.inference_mode():
            for step in range(decode_tokens):
                with stopwatch.timed(decode_ms[name]):
                    run_tokens(model, cache, token, ids.shape[1] + step)
        if stopwatch.cuda:
            reserved[name] = torch.cuda.max_memory_reserved(ids.device) / 2**30
        del cache
    return reserved, decode_ms


def check_bars(report: Report) -> None:
    """Whether each of ``BARS`` holds, per attention implementation measured: a "bars" row each, its "holds" "n/a"
    where its row was not measured (or not on this device)."""
    prefill_rows, memory_rows = report.sections.get("prefill", []), report.sections.get("memory", [])
    for attention in dict.fromkeys(row["attention"] for row in prefill_rows):
        for column, press, (context, batch), bound in BARS:
            key = (attention, context, batch)
            if column == "graph pools GiB":
                value = _column(memory_rows, key, None, column)
            elif column == "peak reserved GiB above SnapKV":
                own, base = (_column(prefill_rows, key, name, "peak reserved GiB") for name in (press, BASE))
                value = own - base if isinstance(own, float) and isinstance(base, float) else None
            else:
                value = _column(prefill_rows, key, press, column)
            measured = isinstance(value, float)
            report.add(
                "bars",
                {
                    "bar": f"{column} <= {bound:g}",
                    "press": press or "",
                    "context": context,
                    "batch": batch,
                    "attention": attention,
                    "measured": value if measured else "",
                    "holds": value <= bound if measured else "n/a (not measured)",
                },
            )


def _column(rows: list[dict], key: tuple, press: str | None, column: str):
    """``column`` of the row at ``key`` (attention, context, batch) for ``press``; None where there is none."""
    for row in rows:
        if (row["attention"], row["context"], row["batch"], row.get("press")) == (*key, press):
            return row.get(column)
    return None
