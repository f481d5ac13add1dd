"""``KeptRegression``: everything the GRKV solver reads from one layer's cache, and how layers stack."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.problem import gather_rows


@dataclass(frozen=True)
class KeptRegression:
    """The regression GRKV solves for one cache: fit the kept rows to the full cache's window outputs.

    Attributes
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) surrogate queries with RoPE applied, the query heads sharing a KV head stacked along M.
    target : torch.Tensor
        (B, H_kv, M, d) float32 attention outputs of ``queries`` over the full cache.
    kept_keys, kept_values : torch.Tensor
        (B, H_kv, c, d) the kept rows (the plain evicted cache) in the order of ``kept``, in the cache's dtype.
    kept : torch.Tensor
        (B, H_kv, c) long positions of the kept rows, distinct within each head.
    fixed : torch.Tensor
        (B, H_kv, c) bool; True rows are returned unchanged.
    query_positions : torch.Tensor or None
        (M,) long positions of the query rows (causal attention), None for none.
    scale : float
        Softmax scale.
    row_weights : torch.Tensor or None
        (B, H_kv, M) float32 weights of the query rows in the loss (None: every row weighs 1).

    NOTE: the full cache enters only through ``target``, so a regression holds c + M rows per head, not n. Every
    step of the solver is per head (batch and heads are one axis to it), so regressions of the same shape, such
    as several layers of one prompt, stack along the batch axis into one solve whose result for each equals
    solving it alone up to float rounding; a bigger batch keeps more cores busy and dispatches fewer operations.
    """

    queries: torch.Tensor
    target: torch.Tensor
    kept_keys: torch.Tensor
    kept_values: torch.Tensor
    kept: torch.Tensor
    fixed: torch.Tensor
    query_positions: torch.Tensor | None
    scale: float
    row_weights: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept: torch.Tensor,
        fixed: torch.Tensor,
        *,
        query_positions: torch.Tensor | None = None,
        scale: float | None = None,
        full_outputs: torch.Tensor | None = None,
        row_weights: torch.Tensor | None = None,
        check_values: bool = True,
    ) -> KeptRegression:
        """Check the inputs of one cache and reduce it to its regression (arguments as ``grkv_merge`` takes them).

        ``check_values=False`` skips the checks that read tensors' values (``kept`` in range and distinct,
        ``query_positions`` non-negative, ``row_weights`` finite and non-negative): for callers that build them
        (``GRKVPress``, from its base press's selection and the model's weights), where those checks cost tensor
        operations and, on a GPU, synchronisations per layer.

        Raises
        ------
        ValueError
            Naming the argument, for any malformed input.
        """
        _validate(queries, keys, values, kept, fixed, query_positions, scale, full_outputs, row_weights, check_values)
        scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else float(scale)
        if query_positions is not None:
            query_positions = query_positions.to(device=keys.device, dtype=torch.long)
        if full_outputs is None:
            target = full_cache_outputs(queries, keys, values, query_positions=query_positions, scale=scale)
        else:
            target = full_outputs.float()
        kept = kept.long()
        kept_keys, kept_values = gather_rows(kept, keys, values)
        return cls(
            queries=queries,
            target=target,
            kept_keys=kept_keys,
            kept_values=kept_values,
            kept=kept,
            fixed=fixed,
            query_positions=query_positions,
            scale=scale,
            row_weights=None if row_weights is None else row_weights.float(),
        )

    @property
    def batch(self) -> int:
        return self.kept.shape[0]

    def stacks_with(self, other: KeptRegression) -> bool:
        """Whether ``other`` can join this regression in one solve (``stackable``)."""
        return stackable(self, other)

    @classmethod
    def stack(cls, regressions: list[KeptRegression]) -> KeptRegression:
        """One regression holding ``regressions`` (which must stack, see ``stacks_with``) along the batch axis."""
        first = regressions[0]
        if len(regressions) == 1:
            return first
        if not all(first.stacks_with(other) for other in regressions[1:]):
            raise ValueError("only regressions of the same shapes, query positions and scale stack")
        stacked = (
            "queries",
            "target",
            "kept_keys",
            "kept_values",
            "kept",
            "fixed",
            *(("row_weights",) if first.row_weights is not None else ()),
        )
        return cls(**concatenated(regressions, stacked), query_positions=first.query_positions, scale=first.scale)


def stackable(first, other) -> bool:
    """Whether two regressions can be solved as one: same shapes, query positions and scale, and row weights on both
    or neither. Either may be anything holding ``KeptRegression``'s tensors under its names (``queries``, ``kept``,
    ``kept_keys``, ``query_positions``, ``scale``, ``row_weights``), such as a press's layer waiting for its group."""
    same_shapes = (
        first.queries.shape[1:] == other.queries.shape[1:]
        and first.kept.shape[1:] == other.kept.shape[1:]
        and first.kept_keys.dtype == other.kept_keys.dtype
        and first.queries.device == other.queries.device
        and first.scale == other.scale
        and (first.row_weights is None) == (other.row_weights is None)
    )
    mine, theirs = first.query_positions, other.query_positions
    # NOTE: the same tensor needs no comparison of values (``GRKVPress`` hands every layer of a prefill one
    # positions tensor); comparing the values reads them on the host, a GPU synchronisation.
    return same_shapes and (
        mine is theirs
        or (mine is not None and theirs is not None and mine.shape == theirs.shape and torch.equal(mine, theirs))
    )


def concatenated(items: list, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``{name: the items' tensors of that name joined along the batch axis}`` (one item's own tensors, uncopied)."""
    if len(items) == 1:
        return {name: getattr(items[0], name) for name in names}
    return {name: torch.cat([getattr(item, name) for item in items]) for name in names}


def _validate(
    queries, keys, values, kept, fixed, query_positions, scale, full_outputs, row_weights, check_values: bool = True
) -> None:
    """Raise a ValueError naming the argument for any malformed tensor (never a torch error deep inside)."""
    for name, tensor in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim != 4:
            raise ValueError(f"{name} must have shape (B, H_kv, length, d), got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if values.shape != keys.shape:
        raise ValueError(f"values shape {tuple(values.shape)} must equal keys shape {tuple(keys.shape)}")
    batch, heads, length, head_dim = keys.shape
    if queries.shape[:2] != (batch, heads) or queries.shape[3] != head_dim:
        raise ValueError(
            f"queries shape {tuple(queries.shape)} must be (B={batch}, H_kv={heads}, M, d={head_dim}) to match keys"
        )
    if queries.shape[2] == 0:
        raise ValueError("queries must hold at least one query row (M >= 1)")
    for name, tensor in (("kept", kept), ("fixed", fixed)):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3 or tensor.shape[:2] != (batch, heads):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have shape (B={batch}, H_kv={heads}, c), got {shape}")
    if kept.dtype.is_floating_point or kept.dtype == torch.bool or kept.is_complex():
        raise ValueError(f"kept must be an integer (long) tensor, got {kept.dtype}")
    if fixed.dtype != torch.bool:
        raise ValueError(f"fixed must be a bool tensor, got {fixed.dtype}")
    if fixed.shape != kept.shape:
        raise ValueError(f"fixed shape {tuple(fixed.shape)} must equal kept shape {tuple(kept.shape)}")
    budget = kept.shape[2]
    if not 1 <= budget <= length:
        raise ValueError(f"kept must select between 1 and n={length} positions per head, got c={budget}")
    if query_positions is not None:
        if not isinstance(query_positions, torch.Tensor) or query_positions.shape != (queries.shape[2],):
            shape = tuple(query_positions.shape) if isinstance(query_positions, torch.Tensor) else query_positions
            raise ValueError(f"query_positions must have shape (M={queries.shape[2]},), got {shape}")
        if query_positions.is_floating_point() or query_positions.dtype == torch.bool:
            raise ValueError(f"query_positions must be an integer tensor, got {query_positions.dtype}")
    if check_values:
        _validate_positions(kept, query_positions, batch, heads, length)
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if full_outputs is not None:
        if not isinstance(full_outputs, torch.Tensor) or full_outputs.shape != queries.shape:
            shape = tuple(full_outputs.shape) if isinstance(full_outputs, torch.Tensor) else type(full_outputs).__name__
            raise ValueError(f"full_outputs must have the shape of queries {tuple(queries.shape)}, got {shape}")
        if not full_outputs.is_floating_point():
            raise ValueError(f"full_outputs must be a floating-point tensor, got {full_outputs.dtype}")
    if row_weights is not None:
        if not isinstance(row_weights, torch.Tensor) or row_weights.shape != queries.shape[:3]:
            shape = tuple(row_weights.shape) if isinstance(row_weights, torch.Tensor) else type(row_weights).__name__
            raise ValueError(f"row_weights must have shape (B, H_kv, M) = {tuple(queries.shape[:3])}, got {shape}")
        if not row_weights.is_floating_point() or (
            check_values and (not bool(torch.isfinite(row_weights).all()) or bool((row_weights < 0).any()))
        ):
            raise ValueError("row_weights must be finite, non-negative floating-point weights")
    tensors = [queries, keys, values, kept, fixed] + [t for t in (full_outputs, row_weights) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            "queries, keys, values, kept, fixed (and full_outputs, row_weights) must be on one device, "
            f"got {sorted(map(str, devices))}"
        )


def _validate_positions(kept: torch.Tensor, query_positions, batch: int, heads: int, length: int) -> None:
    """The checks that read position values: ``kept`` in [0, length) and distinct per head, ``query_positions`` >= 0."""
    lowest, highest = (int(bound) for bound in torch.aminmax(kept))
    if lowest < 0 or highest >= length:
        raise ValueError(f"kept positions must lie in [0, {length}), got range [{lowest}, {highest}]")
    # NOTE: distinct positions mark exactly c slots of a head's n; a repeat marks fewer.
    marked = torch.zeros(batch, heads, length, dtype=torch.bool, device=kept.device).scatter_(-1, kept.long(), True)
    if int(marked.sum()) != kept.numel():
        raise ValueError("kept must not repeat a position within a (batch, head)")
    if query_positions is not None and bool((query_positions < 0).any()):
        raise ValueError("query_positions must be non-negative")
