"""End-to-end prefill cost of GRKV: a whole model's prefill under the base press alone and with GRKV behind it.

    python -m benchmarks.prefill_cost                               # SmolLM2-135M, 2,048 essay tokens, CPU
    python -m benchmarks.prefill_cost --variant cg8=grkv:cg_max_iter=8 --rounds 7

Every round prefills the same prompt (``--tokens`` tokens of the Paul Graham essays, the RULER haystack) once
under each press, in turn: SnapKV alone, SnapKV + GRKV as shipped (safeguard on), the same without the safeguard
(``safeguard=False``, the paper's key step), and any ``--variant``. Alternating the presses inside each round exposes
them to the same background load, so the ratios stay meaningful on a shared machine; printed are the median
time over ``--rounds`` rounds (after one untimed warm-up round) and the median of the per-round ratios to the
base press (each round's presses share that round's load). On a shared 2-core machine a whole prefill still
varies by ±5% between consecutive runs, so the script also times, inside the same prefills, each press's
compression hook (kvpress's ``forward_hook``: scoring, selection and, for GRKV, the merge), summed over the
layers: GRKV's hook time minus the base press's, over the base prefill, is the overhead with the layers'
noise taken out ("added in hooks"). ``--heap`` controls glibc's
heap between prefills as in ``solver_cost.py`` (``keep`` by default: freed memory is reused, never handed back
mid-prefill, which otherwise adds 3-6 ms stalls at random places). The
prefill is everything GRKV adds to (scoring, selection, surrogate queries, the merge, the cache swap), so
this is the cost a user sees, unlike ``solver_cost.py``, which times the merge against one layer.

``--breakdown`` splits each GRKV press's hook time, in the same prefills, into its solves (``LayerGroups.solve``, or
the per-layer solve with ``layers_per_solve=1``), its per-layer set-up (``layer_context``: the surrogate queries and
target; ``merge_selected`` less any solve in it: the fixed rows and the regression's inputs) and the rest (the base
press's scoring and selection, which the base press's own hook also pays, and the hook's glue).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import torch
import transformers

from benchmarks.solver_cost import HEAP_SETTINGS, heap_preparation
from grkv_core.datasets.ruler import load_essay_corpus
from grkv_core.evaluation.generation import prefill
from grkv_core.merger_flags import parse_merge_variant
from grkv_core.models import load_model
from grkv_core.presses.from_config import build_press
from grkv_core.presses.grkv import GRKVPress
from grkv_core.presses.layer_groups import LayerGroups


def essay_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """(1, tokens) ids of the essay haystack's first ``tokens`` tokens."""
    words = load_essay_corpus().words
    ids = tokenizer.encode(" ".join(words[: 2 * tokens]), add_special_tokens=False)
    if len(ids) < tokens:
        raise SystemExit(f"the essay corpus holds only {len(ids)} tokens; ask for fewer with --tokens")
    return torch.tensor([ids[:tokens]])


def timed_hook(hook, total: list[float], on_cuda: bool):
    """Wrap a press's forward hook so that its wall time accumulates in ``total[0]``."""

    def timed(*args, **kwargs):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = hook(*args, **kwargs)
        if on_cuda:
            torch.cuda.synchronize()
        total[0] += time.perf_counter() - start
        return output

    return timed


class MergeParts:
    """Wall time of GRKV's parts inside its hooks, per press (``--breakdown``): ``solve`` and ``set-up``."""

    def __init__(self) -> None:
        self.seconds: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    @contextlib.contextmanager
    def installed(self):
        """Time ``GRKVPress``'s set-up and solves, and ``LayerGroups.solve``, while the context is open."""
        originals = {
            (GRKVPress, name): getattr(GRKVPress, name) for name in ("layer_context", "merge_selected", "_solve")
        }
        originals[(LayerGroups, "solve")] = LayerGroups.solve
        # NOTE: a group's solve belongs to the press whose ``_fixed`` chooses its fixed rows.
        owner = {LayerGroups: lambda groups: groups.fixed_rows.__self__, GRKVPress: lambda press: press}
        part = {"layer_context": "set-up", "merge_selected": "set-up", "_solve": "solve", "solve": "solve"}
        for (cls, name), method in originals.items():
            setattr(cls, name, self._timed(method, part[name], owner[cls]))
        try:
            yield self
        finally:
            for (cls, name), method in originals.items():
                setattr(cls, name, method)

    def _timed(self, method, part: str, owner):
        def timed(instance, *args, **kwargs):
            counter = self.seconds[id(owner(instance))]
            solves_before, start = counter["solve"], time.perf_counter()
            try:
                return method(instance, *args, **kwargs)
            finally:
                # NOTE: a solve inside the set-up (``merge_selected`` without layer groups) counts as a solve only.
                counter[part] += (
                    time.perf_counter() - start - (counter["solve"] - solves_before if part == "set-up" else 0.0)
                )

        return timed


def add_prefill_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options every prefill benchmark here shares: the model, the base press and its budget, the essay prompt's
    length, how many prefills are timed per press and the CPU heap's handling."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--press", default="snapkv")
    parser.add_argument("--compression-ratio", type=float, default=0.9)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--heap", choices=HEAP_SETTINGS, default="keep", help="CPU heap handling (solver_cost.py)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prefill_arguments(parser, rounds=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=MERGE[:k=v,...]",
        help="another merger configuration to time (grkv compare's --merge-variant syntax), "
        "e.g. cg8=grkv:cg_max_iter=8",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also split each GRKV press's hook time into its solves, set-up and the rest",
    )
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    before_each = heap_preparation(args.heap, loaded.model.device)
    ids = essay_prompt(loaded.tokenizer, args.tokens)
    presses = {
        args.press: build_press(args.press, args.compression_ratio),
        f"{args.press}+grkv": build_press(args.press, args.compression_ratio, merge="grkv"),
        f"{args.press}+grkv (no safeguard)": build_press(
            args.press, args.compression_ratio, merge="grkv", safeguard=False
        ),
    }
    for text in args.variant:
        name, merge, options = parse_merge_variant(text)
        presses[f"{args.press}+{merge} {name}"] = build_press(
            args.press, args.compression_ratio, merge=merge, **options
        )
    on_cuda = loaded.model.device.type == "cuda"
    hook_seconds = {name: [0.0] for name in presses}
    for name, press in presses.items():
        press.forward_hook = timed_hook(press.forward_hook, hook_seconds[name], on_cuda)
    times: dict[str, list[float]] = {name: [] for name in presses}
    parts = MergeParts()
    with parts.installed() if args.breakdown else contextlib.nullcontext():
        for round_index in range(args.rounds + 1):
            for name, press in presses.items():
                if before_each is not None:
                    before_each()
                if on_cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                prefill(loaded.model, ids, press)
                if on_cuda:
                    torch.cuda.synchronize()
                if round_index > 0:  # round 0 warms up every press's shapes
                    times[name].append(time.perf_counter() - start)
                else:
                    hook_seconds[name][0] = 0.0
                    parts.seconds.pop(id(press), None)

    print(
        f"model={args.model} tokens={args.tokens} press={args.press} keep={1 - args.compression_ratio:.0%} "
        f"rounds={args.rounds} threads={torch.get_num_threads()} device={loaded.model.device} "
        f"dtype={loaded.model.dtype} heap={args.heap}"
    )
    print(f"{'press':44s} {'median s':>9s} {'vs base':>9s} {'added in hooks':>15s}   per-round ratios")
    base_prefill = statistics.median(times[args.press])
    for name, samples in times.items():
        ratios = [sample / base_sample - 1 for sample, base_sample in zip(samples, times[args.press])]
        per_round = " ".join(f"{ratio:+.1%}" for ratio in ratios)
        added = (hook_seconds[name][0] - hook_seconds[args.press][0]) / args.rounds / base_prefill
        print(
            f"{name:44s} {statistics.median(samples):9.3f} {statistics.median(ratios):+9.1%} {added:+15.2%}   "
            f"{per_round}"
        )
    if args.breakdown:
        print("\nGRKV's hook time over the base press's prefill, by part (mean over the rounds; GPU: not synchronised)")
        print(f"{'press':44s} {'solves':>8s} {'set-up':>8s} {'rest':>8s}   (rest: hook - solves - set-up - base hook)")
        base_hook = hook_seconds[args.press][0]
        for name, press in presses.items():
            if id(press) not in parts.seconds:
                continue
            solve, setup = parts.seconds[id(press)]["solve"], parts.seconds[id(press)]["set-up"]
            rest = hook_seconds[name][0] - solve - setup - base_hook
            shares = (value / args.rounds / base_prefill for value in (solve, setup, rest))
            print(f"{name:44s} " + " ".join(f"{share:+8.2%}" for share in shares))


if __name__ == "__main__":
    main()
