"""The solve as a CUDA graph: captured once per shape, from a bounded cache, and replayed.

On a GPU an eager solve is bound by dispatch: a few hundred small kernels, each launched by the host. A CUDA graph
launches them all at once. ``merge_heads`` reads nothing on the host, so it can be captured; its shapes come from the
regression's, of which only the budget c changes with the prompt (the query rows come from the configuration and the
heads from the model), so c is padded up to a multiple of ``BUDGET_BUCKET`` and one graph serves every prompt whose
budget falls in the same bucket.

NOTE: a padded kept row sits at a position no query sees (causal attention masks it out exactly: its weight is 0) and
is held fixed; the real rows' results equal the eager solve's up to float rounding (sums over the extra zero terms
may round otherwise), and a replay equals the eager solve of the same padded regression bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Callable

import torch

from grkv_core.options import SolverOptions
from grkv_core.solver.regression import KeptRegression

# The budget c is padded up to a multiple of this, so that prompts of similar lengths share a graph.
BUDGET_BUCKET = 64
# A kept position beyond every query: padded rows are masked out of every query's attention.
_UNSEEN = torch.iinfo(torch.int64).max
_TENSOR_FIELDS = ("queries", "target", "kept_keys", "kept_values", "kept", "fixed", "query_positions", "row_weights")

Solve = Callable[[KeptRegression, SolverOptions], tuple[torch.Tensor, ...]]


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: KeptRegression
    outputs: tuple[torch.Tensor, ...]


class CapturedSolves:
    """CUDA graphs of a solve, one per (solve, options, padded shapes), the ``capacity`` most recently used kept.

    ``enabled`` False runs every solve eagerly (as on the CPU). Every graph allocates from one memory pool, created at
    the first capture: a capture reuses the memory the graphs captured before it freed (their intermediate tensors, an
    evicted graph's outputs), so the pool holds about the largest graph's work space plus the kept graphs' outputs,
    not every graph's work space (a pool per graph held 19.4 GiB on an H200, issue #50).

    NOTE: sharing the pool is safe because replays run one at a time, on the current stream, and every replay's
    outputs are cloned at once, before another replay can overwrite them (its intermediate tensors may lie where
    this graph's outputs do); a graph's live outputs are never handed to a later capture, and its inputs are
    allocated outside the pool.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.enabled = True
        self.captures = 0  # graphs captured so far (successfully or not), for the benchmarks' first-request cost
        self._graphs: collections.OrderedDict[tuple, _Graph | None] = collections.OrderedDict()
        self._pool = None

    def __call__(self, solve: Solve, regression: KeptRegression, options: SolverOptions) -> tuple[torch.Tensor, ...]:
        if not (self.enabled and regression.kept_keys.is_cuda):
            return solve(regression, options)
        budget = regression.kept.shape[-1]
        padded = pad_budget(regression, -budget % BUDGET_BUCKET)
        key = (
            solve,
            options,
            padded.scale,
            tuple(
                None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.device)
                for tensor in map(lambda name: getattr(padded, name), _TENSOR_FIELDS)
            ),
        )
        if key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._graphs[key] = _capture(solve, padded, options, self._pool)
            self.captures += 1
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        entry = self._graphs[key]
        if entry is None:  # NOTE: this shape could not be captured (warned once): it runs eagerly
            return solve(regression, options)
        with torch.inference_mode(False), torch.no_grad():
            for name in _TENSOR_FIELDS:
                if getattr(padded, name) is not None:
                    getattr(entry.inputs, name).copy_(getattr(padded, name))
            entry.graph.replay()
            merged_keys, merged_values, *rest = (output.clone() for output in entry.outputs)
        return (merged_keys[:, :, :budget], merged_values[:, :, :budget], *rest)

    def clear(self) -> None:
        """Drop every graph and the pool's handle (the next capture starts a new pool; the old one's memory goes back
        to the device at the next ``torch.cuda.empty_cache()``)."""
        self._graphs.clear()
        self._pool = None

    def pool_bytes(self) -> int:
        """Bytes of device memory the graphs' pool holds (its segments: in use or cached for the next capture); 0
        before the first capture."""
        if self._pool is None:
            return 0
        pool = tuple(self._pool)
        return sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment["segment_pool_id"]) == pool
        )


def pad_budget(regression: KeptRegression, extra: int) -> KeptRegression:
    """``regression`` with ``extra`` kept rows appended per head: zero, fixed, and seen by no query (non-causal
    regressions become causal with every real row visible)."""
    if extra == 0:
        return regression
    batch, heads, _, head_dim = regression.kept_keys.shape
    zeros = regression.kept_keys.new_zeros(batch, heads, extra, head_dim)
    query_positions = regression.query_positions
    if query_positions is None:
        query_positions = torch.full(
            (regression.queries.shape[2],), _UNSEEN - 1, dtype=torch.long, device=regression.kept.device
        )
    return dataclasses.replace(
        regression,
        kept_keys=torch.cat([regression.kept_keys, zeros], dim=2),
        kept_values=torch.cat([regression.kept_values, zeros], dim=2),
        kept=torch.cat([regression.kept, regression.kept.new_full((batch, heads, extra), _UNSEEN)], dim=2),
        fixed=torch.cat([regression.fixed, regression.fixed.new_ones(batch, heads, extra)], dim=2),
        query_positions=query_positions,
    )


def _capture(solve: Solve, regression: KeptRegression, options: SolverOptions, pool) -> _Graph | None:
    """Capture ``solve`` on copies of ``regression``'s tensors (the graph's inputs from then on), after two warm-up
    runs on a side stream (cuBLAS and cuSOLVER set up their workspaces outside the capture), into the memory pool
    ``pool`` (``torch.cuda.graph_pool_handle()``); None, with a warning, where the capture fails."""
    # NOTE: cuSOLVER for the factorisations while capturing: MAGMA's batched routines have met an assertion in a fresh
    # process on an H200, and a capture fails on any routine that synchronises.
    linear_algebra = torch.backends.cuda.preferred_linalg_library()
    torch.backends.cuda.preferred_linalg_library("cusolver")
    try:
        with torch.inference_mode(False), torch.no_grad():
            inputs = dataclasses.replace(
                regression,
                **{
                    name: getattr(regression, name).clone()
                    for name in _TENSOR_FIELDS
                    if getattr(regression, name) is not None
                },
            )
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    solve(inputs, options)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = solve(inputs, options)
        return _Graph(graph, inputs, tuple(outputs))
    except RuntimeError as error:
        warnings.warn(
            f"grkv_merge: the solve could not be captured as a CUDA graph ({error}); it runs eagerly for this shape",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    finally:
        torch.backends.cuda.preferred_linalg_library(linear_algebra)


# The process's graphs: ``solve_regression`` runs every solve through it.
CAPTURED_SOLVES = CapturedSolves()
