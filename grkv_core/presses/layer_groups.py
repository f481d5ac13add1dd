"""Layer groups: the merges of consecutive layers solved together, in one batched call (``layers_per_solve``).

One batched solve of several layers keeps more cores busy and dispatches fewer operations than one per layer
(docs/results/prefill-cost.md). A layer whose merge waits hands kvpress its kept rows unmerged; they are merged in
place when the last layer of its group is compressed.

NOTE: this is safe because nothing reads a layer's cache between its own attention and the end of the prefill's
forward, and the group is solved at the latest at the last layer kvpress hooked, within that forward: what follows
sees only merged caches. It needs the press's own context manager, where nothing runs after its hook on a layer;
inside ``ComposedPress`` or ``PrefillDecodingPress`` every layer is merged at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grkv_core.options import SolverOptions
from grkv_core.solver.merge import SolveIssues, solve_regression
from grkv_core.solver.regression import KeptRegression, concatenated, stackable

# The largest (heads, query rows, kept rows) float32 attention matrix of one group's solve; a group whose next layer
# would exceed it is solved first. NOTE: the solve keeps several tensors of this size alive at once, and on a GPU its
# captured graph holds them in the graphs' memory pool for as long as it is kept (``solver.capture``): this bounds
# that pool to about a GiB. Llama-3.1-8B at 4K tokens, 10% kept, m = 64 (4 query heads a KV head) solves all 32 layers
# in one group (117 MiB); at 32K, in groups of 4 (27 MiB a layer). With a bound of 1 GiB (all 32 layers at 32K in one
# group) the pools held 19.4 GiB on an H200 (issue #50).
GROUP_ATTENTION_BYTES = 2**27

# (kept positions (B, H_kv, c), the base press's scores of them (B, H_kv, c), the prompt's length) -> (B, H_kv, c) bool,
# the rows held fixed (``GRKVPress._fixed``).
FixedRows = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class LayerMerge:
    """One layer's merge before its fixed rows are chosen: ``KeptRegression``'s tensors, with the base press's scores
    of the kept rows in place of ``fixed``.

    NOTE: the rows held fixed are chosen per row from the kept positions and their scores alone, so a group's are chosen
    in one pass over its stacked layers (``regression``), not once per layer.

    Attributes
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) surrogate queries, RoPE applied, stacked by KV head.
    target : torch.Tensor
        (B, H_kv, M, d) their attention outputs over the full cache (the forward's own in the cache's dtype, or
        computed in float32): widened to float32 once per group, not once per layer.
    kept_keys, kept_values : torch.Tensor
        (B, H_kv, c, d) the kept rows, the very tensors the cache stores.
    kept : torch.Tensor
        (B, H_kv, c) long, their positions, increasing.
    kept_scores : torch.Tensor
        (B, H_kv, c) the base press's scores of them.
    length : int
        n, the prompt's length.
    query_positions : torch.Tensor or None
        (M,) positions of the query rows (causal), shared by every layer of a prefill; None: non-causal.
    scale : float
        The softmax scale.
    row_weights : torch.Tensor or None
        (B, H_kv, M) weights of the query rows in the loss; None: all 1.
    """

    queries: torch.Tensor
    target: torch.Tensor
    kept_keys: torch.Tensor
    kept_values: torch.Tensor
    kept: torch.Tensor
    kept_scores: torch.Tensor
    length: int
    query_positions: torch.Tensor | None
    scale: float
    row_weights: torch.Tensor | None

    @property
    def batch(self) -> int:
        return self.kept.shape[0]

    def stacks_with(self, other: LayerMerge) -> bool:
        """Whether ``other`` can join this merge in one solve: as regressions stack (``stackable``), from prompts of
        one length."""
        return self.length == other.length and stackable(self, other)

    @staticmethod
    def regression(merges: list[LayerMerge], fixed_rows: FixedRows) -> KeptRegression:
        """The ``KeptRegression`` of ``merges`` (which stack) along the batch axis, their fixed rows chosen at once."""
        first = merges[0]
        rows = ("queries", "target", "kept_keys", "kept_values", "kept", "kept_scores")
        joined = concatenated(merges, rows + (("row_weights",) if first.row_weights is not None else ()))
        kept_scores = joined.pop("kept_scores")
        joined["target"] = joined["target"].float()
        return KeptRegression(
            **joined,
            fixed=fixed_rows(joined["kept"], kept_scores, first.length),
            query_positions=first.query_positions,
            scale=first.scale,
        )


class LayerGroups:
    """The merges waiting for the rest of their group within one prefill forward.

    Parameters
    ----------
    size : int
        ``layers_per_solve``: how many layers' merges are solved together; 0: all of them, at the last hooked layer.
    last_layer : int
        The last layer kvpress hooked: its compression solves whatever waits.
    fixed_rows : callable
        Chooses the rows a group holds fixed (``FixedRows``).
    issues : SolveIssues
        Where the solves count what went wrong in some heads.
    stream : torch.cuda.Stream or None
        Where the solves run (``merge_stream="side"``) while the forward goes on; None: in line, on the current stream.

    NOTE: on a side stream, a solve waits for everything queued before it on the forward's stream, and the forward's
    stream waits for every solve queued so far at ``join`` (a wait queued on the device: the host goes on), which the
    press calls at the end of the prefill's forward, before anything can read the cache. Every tensor the forward's
    stream allocated and a solve reads or writes is marked as used by the side stream (``record_stream``), so that the
    allocator hands its memory to nothing else before the solve is done.
    """

    def __init__(
        self,
        size: int,
        last_layer: int,
        fixed_rows: FixedRows,
        issues: SolveIssues,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.size = size
        self.last_layer = last_layer
        self.fixed_rows = fixed_rows
        self.issues = issues
        self.stream = stream
        self._pending: list[tuple[LayerMerge, SolverOptions]] = []

    @classmethod
    def for_press(
        cls,
        press: nn.Module,
        language_model: nn.Module,
        size: int,
        fixed_rows: FixedRows,
        issues: SolveIssues,
        side_stream: bool = False,
    ) -> LayerGroups | None:
        """Groups for ``press`` on ``language_model``, or None where every layer is merged at once (``size`` 1, or
        the press is not hooked on the layers itself: a wrapper runs it); their solves on a side stream with
        ``side_stream`` where the model is on a CUDA device."""
        hooked = [
            layer.self_attn.layer_idx
            for layer in language_model.layers
            if press.forward_hook in layer.self_attn._forward_hooks.values()
        ]
        if size == 1 or not hooked:
            return None
        device = next(language_model.parameters()).device
        stream = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
        return cls(size, max(hooked), fixed_rows, issues, stream)

    def defer(self, merge: LayerMerge, options: SolverOptions) -> None:
        """Let a layer's merge wait; its kept rows (``merge.kept_keys``/``kept_values``, the very tensors the cache
        stores) are overwritten when its group is solved."""
        if self._pending and not (
            self._pending[0][1] == options
            and self._pending[0][0].stacks_with(merge)
            and _attention_bytes(self._pending) + _attention_bytes([(merge, options)]) <= GROUP_ATTENTION_BYTES
        ):
            self.solve()  # NOTE: a group holds one shape (per-layer budgets change c) and a bounded working set
        self._pending.append((merge, options))

    def compressed(self, layer_idx: int) -> None:
        """Called after a layer is compressed: solve the group once it is full or this was the last hooked layer."""
        if self._pending and (len(self._pending) == self.size or layer_idx == self.last_layer):
            self.solve()

    def solve(self) -> None:
        """Solve the pending layers in one call and write each result into the cache rows it handed out."""
        pending, self._pending = self._pending, []
        merges = [merge for merge, _ in pending]
        if self.stream is None:
            self._solve(merges, pending[0][1])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._solve(merges, pending[0][1])
        for merge in merges:
            for tensor in vars(merge).values():
                if isinstance(tensor, torch.Tensor):
                    tensor.record_stream(self.stream)

    def join(self) -> None:
        """Make the current stream wait for every solve queued so far (nothing to do in line)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def _solve(self, merges: list[LayerMerge], options: SolverOptions) -> None:
        regression = LayerMerge.regression(merges, self.fixed_rows)
        merged_keys, merged_values = solve_regression(regression, options, self.issues)
        sizes = [merge.batch for merge in merges]
        for merge, keys, values in zip(merges, merged_keys.split(sizes), merged_values.split(sizes)):
            merge.kept_keys.copy_(keys)
            merge.kept_values.copy_(values)


def keeps_returned_rows(cache, layer_idx: int) -> bool:
    """Whether kvpress's hook stores the very tensors ``compress`` returns as the layer's cache, so that a merge
    finished later, in place, reaches the cache: a plain ``DynamicCache`` layer does; a quantized cache re-encodes
    them and an offloading one moves them."""
    return isinstance(cache, DynamicCache) and not cache.offloading and type(cache.layers[layer_idx]) is DynamicLayer


def _attention_bytes(pending: list[tuple[LayerMerge, SolverOptions]]) -> int:
    """The bytes of the float32 (heads, query rows, kept rows) attention of ``pending``'s merges solved together."""
    return sum(
        4 * merge.kept.shape[0] * merge.kept.shape[1] * merge.queries.shape[2] * merge.kept.shape[2]
        for merge, _ in pending
    )
