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

from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grkv_core.options import SolverOptions
from grkv_core.solver.merge import SolveIssues, solve_regression
from grkv_core.solver.regression import KeptRegression

# The largest (heads, query rows, kept rows) float32 attention matrix of one group's solve; a group whose next layer
# would exceed it is solved first. NOTE: the solve keeps several tensors of this size alive at once; with all layers
# of a long prompt in one group (``layers_per_solve=0``) this bounds its memory: 4 of Llama-3.1-8B's 32 layers at
# 128K tokens, 10% kept, m = 128 (4 query heads a KV head), and every layer below 32K tokens.
GROUP_ATTENTION_BYTES = 2**30

# (regression, merged keys, merged values) -> the (keys, values) written into the cache (e.g. trust-region caps).
Finish = Callable[[KeptRegression, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LayerGroups:
    """The merges waiting for the rest of their group within one prefill forward.

    Parameters
    ----------
    size : int
        ``layers_per_solve``: how many layers' merges are solved together; 0: all of them, at the last hooked layer.
    last_layer : int
        The last layer kvpress hooked: its compression solves whatever waits.
    finish : callable
        Applied to each layer's merge before it is written into the cache.
    issues : SolveIssues
        Where the solves count what went wrong in some heads.
    """

    def __init__(self, size: int, last_layer: int, finish: Finish, issues: SolveIssues) -> None:
        self.size = size
        self.last_layer = last_layer
        self.finish = finish
        self.issues = issues
        self._pending: list[tuple[KeptRegression, SolverOptions]] = []

    @classmethod
    def for_press(
        cls, press: nn.Module, language_model: nn.Module, size: int, finish: Finish, issues: SolveIssues
    ) -> LayerGroups | None:
        """Groups for ``press`` on ``language_model``, or None where every layer is merged at once (``size`` 1, or
        the press is not hooked on the layers itself: a wrapper runs it)."""
        hooked = [
            layer.self_attn.layer_idx
            for layer in language_model.layers
            if press.forward_hook in layer.self_attn._forward_hooks.values()
        ]
        return cls(size, max(hooked), finish, issues) if size != 1 and hooked else None

    def defer(self, regression: KeptRegression, options: SolverOptions) -> None:
        """Let a layer's merge wait; its kept rows (``regression.kept_keys``/``kept_values``, the very tensors the
        cache stores) are overwritten when its group is solved."""
        if self._pending and not (
            self._pending[0][1] == options
            and self._pending[0][0].stacks_with(regression)
            and _attention_bytes(self._pending) + _attention_bytes([(regression, options)]) <= GROUP_ATTENTION_BYTES
        ):
            self.solve()  # NOTE: a group holds one shape (per-layer budgets change c) and a bounded working set
        self._pending.append((regression, options))

    def compressed(self, layer_idx: int) -> None:
        """Called after a layer is compressed: solve the group once it is full or this was the last hooked layer."""
        if self._pending and (len(self._pending) == self.size or layer_idx == self.last_layer):
            self.solve()

    def solve(self) -> None:
        """Solve the pending layers in one call and write each result into the cache rows it handed out."""
        pending, self._pending = self._pending, []
        regressions = [regression for regression, _ in pending]
        merged_keys, merged_values = solve_regression(KeptRegression.stack(regressions), pending[0][1], self.issues)
        sizes = [regression.batch for regression in regressions]
        for regression, keys, values in zip(regressions, merged_keys.split(sizes), merged_values.split(sizes)):
            keys, values = self.finish(regression, keys, values)
            regression.kept_keys.copy_(keys)
            regression.kept_values.copy_(values)


def keeps_returned_rows(cache, layer_idx: int) -> bool:
    """Whether kvpress's hook stores the very tensors ``compress`` returns as the layer's cache, so that a merge
    finished later, in place, reaches the cache: a plain ``DynamicCache`` layer does; a quantized cache re-encodes
    them and an offloading one moves them."""
    return isinstance(cache, DynamicCache) and not cache.offloading and type(cache.layers[layer_idx]) is DynamicLayer


def _attention_bytes(pending: list[tuple[KeptRegression, SolverOptions]]) -> int:
    """The bytes of the float32 (heads, query rows, kept rows) attention of ``pending``'s regressions solved
    together."""
    return sum(
        4 * regression.kept.shape[0] * regression.kept.shape[1] * regression.queries.shape[2] * regression.kept.shape[2]
        for regression, _ in pending
    )
