"""Diagnostics of a compressed cache: how far its attention outputs drift from the full cache's."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from grkv_core.solver import full_cache_outputs, masked_softmax


def reconstruction_loss(
    queries: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    compressed_keys: torch.Tensor,
    compressed_values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    compressed_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> float:
    """The paper's normalised discrepancy Σ‖Y_full − Y_comp‖² / Σ‖Y_full‖² over all queries and heads.

    Parameters
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) post-RoPE queries (GQA groups stacked along M): the surrogate window, or held-out
        queries such as those of the first generated tokens.
    full_keys, full_values : torch.Tensor
        (B, H_kv, n, d) the uncompressed cache; key i sits at position i.
    compressed_keys, compressed_values : torch.Tensor
        (B, H_kv, c, d) the compressed (evicted or merged) cache.
    query_positions : torch.Tensor, optional
        (M,) positions of the query rows; when given attention is causal on both caches.
    compressed_positions : torch.Tensor, optional
        (B, H_kv, c) original positions of the compressed entries; required with ``query_positions``.
    scale : float, optional
        Softmax scale, 1/sqrt(d) by default.

    Returns
    -------
    float
        The normalised discrepancy (0 means the compressed cache reproduces the full outputs exactly).
    """
    error, reference = discrepancy_per_head(
        queries, full_keys, full_values, compressed_keys, compressed_values,
        query_positions=query_positions, compressed_positions=compressed_positions, scale=scale,
    )
    return float(error.sum() / reference.sum().clamp_min(1e-30))


def discrepancy_per_head(
    queries: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    compressed_keys: torch.Tensor,
    compressed_values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    compressed_positions: torch.Tensor | None = None,
    compressed_mask: torch.Tensor | None = None,
    scale: float | None = None,
    full_outputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(batch, head) Σ‖Y_full − Y_comp‖² and Σ‖Y_full‖², each (B, H_kv) float32.

    Arguments as in ``reconstruction_loss``, plus ``compressed_mask`` (B, H_kv, c) bool: False entries of the
    compressed cache are invisible (per-head budgets realised by masking, e.g. AdaKV); and ``full_outputs``
    (B, H_kv, M, d): Y_full when the caller already has it (``solver.full_cache_outputs``), to compare several
    compressed caches against one full-cache pass.
    """
    if queries.ndim != 4 or full_keys.ndim != 4 or compressed_keys.ndim != 4:
        raise ValueError("queries, full_keys and compressed_keys must all be 4-D (B, H_kv, length, d)")
    if full_values.shape != full_keys.shape or compressed_values.shape != compressed_keys.shape:
        raise ValueError("values must have the same shape as their keys")
    if query_positions is not None and compressed_positions is None:
        raise ValueError("compressed_positions is required when query_positions is given")
    if full_outputs is not None and full_outputs.shape != queries.shape:
        raise ValueError(f"full_outputs must have the shape of queries {tuple(queries.shape)}, "
                         f"got {tuple(full_outputs.shape)}")
    scale = 1.0 / math.sqrt(full_keys.shape[-1]) if scale is None else scale
    compressed_visible = None
    if query_positions is not None:
        positions = query_positions.to(full_keys.device).long()
        compressed_visible = compressed_positions.long()[:, :, None, :] <= positions[None, None, :, None]
    if compressed_mask is not None:
        mask = compressed_mask[:, :, None, :]
        compressed_visible = mask if compressed_visible is None else compressed_visible & mask
    if full_outputs is None:
        full_outputs = full_cache_outputs(queries, full_keys, full_values, query_positions=query_positions,
                                          scale=scale)
    full_out = full_outputs.float()
    comp_out = (
        masked_softmax((queries.float() * scale) @ compressed_keys.float().transpose(-1, -2), compressed_visible)
        @ compressed_values.float()
    )
    return (full_out - comp_out).square().sum(dim=(-2, -1)), full_out.square().sum(dim=(-2, -1))


def recover_kept_positions(compressed_keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """Positions in the full cache of the rows of a plainly evicted cache, found by exact row match.

    Parameters
    ----------
    compressed_keys : torch.Tensor
        (B, H_kv, c, d) rows copied verbatim from ``full_keys`` (any order).
    full_keys : torch.Tensor
        (B, H_kv, n, d).

    Returns
    -------
    torch.Tensor
        (B, H_kv, c) long positions.

    Raises
    ------
    ValueError
        If some compressed row is not a row of the full cache (e.g. the cache was merged).
    """
    # NOTE: a row's fingerprint is a weighted sum of its raw bit patterns in wrapping int64 arithmetic, which
    # is exact and independent of summation order: identical rows get identical fingerprints whatever the
    # shapes of the two calls (a floating-point dot product is not: its rounding follows the GEMV blocking).
    # Every candidate is then confirmed by an exact comparison.
    full_prints, compressed_prints = _row_fingerprints(full_keys), _row_fingerprints(compressed_keys)
    order = full_prints.argsort(dim=-1)
    sorted_prints = full_prints.gather(-1, order)
    slot = torch.searchsorted(sorted_prints.contiguous(), compressed_prints.contiguous()).clamp(max=full_keys.shape[2] - 1)
    positions = order.gather(-1, slot)
    matched = full_keys.gather(2, positions.unsqueeze(-1).expand_as(compressed_keys))
    if not torch.equal(matched, compressed_keys):
        raise ValueError("compressed rows are not verbatim rows of the full cache (was it merged?)")
    return positions


_INTEGER_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """(..., d) float rows -> (...) int64 fingerprints that are equal for bit-identical rows."""
    bits = rows.contiguous().view(_INTEGER_OF_WIDTH[rows.element_size()]).long()
    generator = torch.Generator().manual_seed(0)
    weights = torch.randint(1, 2**62, (rows.shape[-1],), generator=generator, dtype=torch.int64) * 2 + 1
    return (bits * weights.to(rows.device)).sum(dim=-1)


# ---------------------------------------------------------------------------------------------------------
# Carrier concentration (paper App. A "Local KV Merging and Carrier Support", App. B "Quantitative Carrier
# Concentration") and the paper's merge-map and cross-window-consistency plots.
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CarrierConcentration:
    """How concentrated a local merge's evicted -> carrier assignment is (paper App. B), for one unit or a mean.

    A unit is one sample-layer-KV-head. With a_i the number of evicted tokens assigned to kept token i
    (i = 1..c, every kept token counts, including those that receive nothing):

    Attributes
    ----------
    n_units : int
        1 for a single unit; the number of units averaged for a macro-average.
    n_kept : float
        c.
    n_assigned : float
        Σ a_i (evicted tokens that were merged; dropped ones do not count).
    active_fraction : float
        b/c with b = Σ 1[a_i > 0], the active carriers.
    effective_fraction : float
        b_eff/c with b_eff = (Σ a_i)² / Σ a_i² (= 1/Σ p_i², p_i = a_i/Σa: c for equal loads, 1 for one carrier).
    gini : float
        Gini coefficient of (a_1..a_c): Σ_i Σ_j |a_i − a_j| / (2 c Σ a) (0 for equal loads, (c−1)/c for one
        carrier).
    max_load_ratio : float
        A_max = max_i a_i / (Σ a_i / c), the maximum load over the mean load (1 for equal loads, c for one
        carrier).
    boundary_carrier_fraction : float
        Boundary carriers / c; the boundary carriers are the first and last kept token of each span (maximal
        run of consecutive kept positions; a one-token span has one boundary carrier).
    boundary_assignment_ratio : float
        Share of the assignments that go to boundary carriers.
    enrichment : float
        boundary_assignment_ratio / boundary_carrier_fraction (1 when boundaries get their fair share).
    boundary_interior_load : float
        Mean load of boundary carriers / mean load of interior carriers. NaN when the unit lacks either kind
        (the paper computes it only for units with both); inf when interior carriers receive nothing.
    """

    n_units: int
    n_kept: float
    n_assigned: float
    active_fraction: float
    effective_fraction: float
    gini: float
    max_load_ratio: float
    boundary_carrier_fraction: float
    boundary_assignment_ratio: float
    enrichment: float
    boundary_interior_load: float


def span_boundaries(kept_positions: torch.Tensor) -> torch.Tensor:
    """(c,) bool: True for the first and the last kept token of each span of consecutive kept positions.

    Parameters
    ----------
    kept_positions : torch.Tensor
        (c,) strictly increasing positions.
    """
    starts, ends = _span_edges(kept_positions)
    return starts | ends


def carrier_loads(assignment: torch.Tensor, n_kept: int) -> torch.Tensor:
    """(c,) float64 a_i: how many evicted tokens ``assignment`` (e,) sends to each kept index (-1 = dropped)."""
    _check_assignment(assignment, n_kept)
    return torch.bincount(assignment[assignment >= 0].long().cpu(), minlength=n_kept).double()


def carrier_concentration(assignment: torch.Tensor, kept_positions: torch.Tensor) -> CarrierConcentration:
    """Carrier concentration of one sample-layer-head unit (paper App. B).

    Parameters
    ----------
    assignment : torch.Tensor
        (e,) integer: for each evicted token, the index into ``kept_positions`` of its carrier, -1 if it was
        dropped (e.g. below D2O's threshold). This is what the baselines' ``assign_carriers`` returns for
        one (batch, head).
    kept_positions : torch.Tensor
        (c,) strictly increasing positions of the kept tokens.

    Raises
    ------
    ValueError
        On malformed input, or when no evicted token is assigned (the shares are then undefined).
    """
    boundary = span_boundaries(kept_positions).cpu()
    loads = carrier_loads(assignment, kept_positions.numel())
    total = float(loads.sum())
    if total == 0:
        raise ValueError("no evicted token is assigned to a carrier: carrier concentration is undefined")
    n_kept = loads.numel()
    ascending = loads.sort().values
    rank = torch.arange(1, n_kept + 1, dtype=torch.float64)
    # NOTE: the sorted-rank form equals Σ_i Σ_j |a_i − a_j| / (2 c Σa) in O(c log c).
    gini = float(2 * (rank * ascending).sum() / (n_kept * total) - (n_kept + 1) / n_kept)
    boundary_fraction = float(boundary.double().mean())
    boundary_ratio = float(loads[boundary].sum()) / total
    interior = ~boundary
    if interior.any():
        interior_load = float(loads[interior].mean())
        boundary_load = float(loads[boundary].mean())
        boundary_interior = boundary_load / interior_load if interior_load > 0 else math.inf
    else:
        boundary_interior = math.nan
    return CarrierConcentration(
        n_units=1,
        n_kept=float(n_kept),
        n_assigned=total,
        active_fraction=float((loads > 0).double().mean()),
        effective_fraction=total**2 / float(loads.square().sum()) / n_kept,
        gini=gini,
        max_load_ratio=float(loads.max()) / (total / n_kept),
        boundary_carrier_fraction=boundary_fraction,
        boundary_assignment_ratio=boundary_ratio,
        enrichment=boundary_ratio / boundary_fraction,
        boundary_interior_load=boundary_interior,
    )


def carrier_concentration_per_unit(
    assignment: torch.Tensor, kept_positions: torch.Tensor
) -> list[CarrierConcentration | None]:
    """``carrier_concentration`` for every unit of a batch of units.

    Parameters
    ----------
    assignment : torch.Tensor
        (..., e) integer carrier indices (e.g. (B, H_kv, e) from a baseline's ``assign_carriers``).
    kept_positions : torch.Tensor
        (..., c) kept positions, with the same leading shape.

    Returns
    -------
    list of CarrierConcentration or None
        One entry per unit in row-major order of the leading axes; None where the unit assigned nothing.
    """
    if assignment.shape[:-1] != kept_positions.shape[:-1]:
        raise ValueError(f"assignment {tuple(assignment.shape)} and kept_positions {tuple(kept_positions.shape)} "
                         "must share their leading (unit) axes")
    units = []
    for unit_assignment, unit_kept in zip(assignment.reshape(-1, assignment.shape[-1]),
                                          kept_positions.reshape(-1, kept_positions.shape[-1])):
        units.append(carrier_concentration(unit_assignment, unit_kept) if bool((unit_assignment >= 0).any()) else None)
    return units


def macro_average(units: Iterable[CarrierConcentration | None]) -> CarrierConcentration:
    """Macro-average over units, as the paper reports: each unit weighs the same.

    Units given as None (nothing assigned) are skipped. ``boundary_interior_load`` is averaged over the units
    where it is defined (not NaN); an inf there makes the average inf. ``n_units`` counts the averaged units.

    Raises
    ------
    ValueError
        If no unit is left to average.
    """
    units = [unit for unit in units if unit is not None]
    if not units:
        raise ValueError("macro_average needs at least one unit with assignments")
    averaged = {}
    for field in fields(CarrierConcentration):
        if field.name == "n_units":
            continue
        values = [getattr(unit, field.name) for unit in units]
        defined = [value for value in values if not math.isnan(value)]
        averaged[field.name] = sum(defined) / len(defined) if defined else math.nan
    return CarrierConcentration(n_units=sum(unit.n_units for unit in units), **averaged)


def plot_merge_map(
    path: str | os.PathLike[str],
    keys: torch.Tensor,
    kept_positions: torch.Tensor,
    assignment: torch.Tensor,
    *,
    title: str | None = None,
) -> Path:
    """Write the paper's KV merge map (Fig. 1, App. B) of one unit as a PNG.

    Each point is one (evicted -> carrier) pair: x = the carrier's original token index, y = the evicted
    token's original index, colour = cosine similarity of their keys. The dashed diagonal marks merges onto
    the nearest positions; black bars under the x axis mark the kept spans. Dropped tokens are not drawn.

    Parameters
    ----------
    path : path-like
        Output PNG file (parent directories are created).
    keys : torch.Tensor
        (n, d) the unit's full key cache.
    kept_positions : torch.Tensor
        (c,) strictly increasing kept positions.
    assignment : torch.Tensor
        (n − c,) carrier index per evicted token, evicted tokens in increasing position; -1 = dropped.
    title : str, optional

    Returns
    -------
    Path
        The written file.
    """
    if keys.ndim != 2:
        raise ValueError(f"keys must be (n, d) for one unit, got {tuple(keys.shape)}")
    length = keys.shape[0]
    _check_kept_positions(kept_positions)
    kept_positions = kept_positions.cpu().long()
    if int(kept_positions[-1]) >= length:
        raise ValueError(f"kept positions must lie in [0, {length})")
    kept_mask = torch.zeros(length, dtype=torch.bool)
    kept_mask[kept_positions] = True
    evicted_positions = (~kept_mask).nonzero()[:, 0]
    if assignment.shape != evicted_positions.shape:
        raise ValueError(f"assignment must have one entry per evicted token ({evicted_positions.numel()}), "
                         f"got shape {tuple(assignment.shape)}")
    assignment = assignment.cpu()
    _check_assignment(assignment, kept_positions.numel())
    merged = assignment >= 0
    carrier_positions = kept_positions[assignment[merged]]
    sources = evicted_positions[merged]
    unit_keys = torch.nn.functional.normalize(keys.detach().float().cpu(), dim=-1)
    similarity = (unit_keys[sources] * unit_keys[carrier_positions]).sum(-1)

    figure, axes = _figure((7.0, 6.0))
    points = axes.scatter(carrier_positions.numpy(), sources.numpy(), c=similarity.numpy(), cmap="viridis", s=8,
                          vmin=min(0.0, float(similarity.min())) if similarity.numel() else 0.0, vmax=1.0)
    figure.colorbar(points, ax=axes, label="key cosine similarity (evicted, carrier)")
    axes.plot([0, length - 1], [0, length - 1], linestyle="--", color="grey", linewidth=0.8)
    spans = _spans(kept_positions)
    axes.broken_barh([(start, stop - start + 1) for start, stop in spans], (0.0, 0.025),
                     transform=axes.get_xaxis_transform(), color="black")
    axes.set_xlim(-0.5, length - 0.5)
    axes.set_ylim(-0.5, length - 0.5)
    axes.set_xlabel("retained (carrier) token index")
    axes.set_ylabel("evicted token index")
    axes.set_title(title or f"KV merge map: {int(merged.sum())} evicted -> {kept_positions.numel()} retained")
    return _save(figure, path)


def window_output_summaries(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    window: int = 32,
    scale: float | None = None,
) -> torch.Tensor:
    """Window summaries s_W = (1/m) Σ_{i∈W} A_i^(full) V_full (paper Sec. 3.2, App. C).

    Parameters
    ----------
    queries : torch.Tensor
        (..., T, d) post-RoPE queries of the tokens at positions 0..T−1 (one query head, or heads on the
        leading axes with their KV heads already repeated); query t attends causally to keys 0..t.
    keys, values : torch.Tensor
        (..., T, d) the full cache.
    window : int
        m, the window length; the tokens are cut into ⌊T/m⌋ consecutive windows, a trailing partial window is
        left out.
    scale : float, optional
        Softmax scale, 1/sqrt(d) by default.

    Returns
    -------
    torch.Tensor
        (..., ⌊T/m⌋, d) float32 window summaries.
    """
    if queries.shape[-2] != keys.shape[-2] or keys.shape != values.shape:
        raise ValueError("queries, keys and values must all be (..., T, d) over the same T tokens")
    if not isinstance(window, int) or window < 1 or window > queries.shape[-2]:
        raise ValueError(f"window must be an integer in [1, T={queries.shape[-2]}], got {window!r}")
    length = keys.shape[-2]
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else scale
    causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
    outputs = masked_softmax((queries.float() * scale) @ keys.float().transpose(-1, -2), causal) @ values.float()
    n_windows = length // window
    return outputs[..., : n_windows * window, :].unflatten(-2, (n_windows, window)).mean(dim=-2)


def cross_window_similarity(summaries: torch.Tensor) -> torch.Tensor:
    """(..., W, W) cosine similarity cos(s_{W_u}, s_{W_v}) between the window summaries (..., W, d)."""
    unit = torch.nn.functional.normalize(summaries.float(), dim=-1)
    return unit @ unit.transpose(-1, -2)


def plot_cross_window_consistency(
    path: str | os.PathLike[str],
    similarity: torch.Tensor,
    *,
    prompt_windows: int | None = None,
    title: str | None = None,
) -> Path:
    """Write the cross-window consistency heatmap (paper Fig. 2, App. C) of one layer-head as a PNG.

    Parameters
    ----------
    path : path-like
        Output PNG file (parent directories are created).
    similarity : torch.Tensor
        (W, W) from ``cross_window_similarity``.
    prompt_windows : int, optional
        The number of leading windows that belong to the prompt; a line separates them from the
        future-query windows (the paper splits 90% / 10%).
    title : str, optional

    Returns
    -------
    Path
        The written file.
    """
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"similarity must be a square (W, W) matrix, got {tuple(similarity.shape)}")
    n_windows = similarity.shape[0]
    if prompt_windows is not None and not 0 < prompt_windows < n_windows:
        raise ValueError(f"prompt_windows must be in (0, {n_windows}), got {prompt_windows!r}")
    figure, axes = _figure((6.0, 5.0))
    similarity = similarity.detach().float().cpu()
    # NOTE: the colour scale runs from the data's minimum to 1 so that small departures from 1 stay visible.
    image = axes.imshow(similarity.numpy(), cmap="magma", vmin=min(float(similarity.min()), 1.0 - 1e-3), vmax=1.0,
                        origin="upper", interpolation="nearest")
    figure.colorbar(image, ax=axes, label="cos(s_Wu, s_Wv)")
    if prompt_windows is not None:
        for draw in (axes.axvline, axes.axhline):
            draw(prompt_windows - 0.5, color="cyan", linewidth=1.2)
    axes.set_xlabel("window v")
    axes.set_ylabel("window u")
    axes.set_title(title or f"cross-window consistency, {n_windows} windows")
    return _save(figure, path)


def _check_kept_positions(kept_positions: torch.Tensor) -> None:
    if kept_positions.ndim != 1 or kept_positions.numel() == 0 or kept_positions.is_floating_point():
        raise ValueError(f"kept_positions must be a non-empty 1-D integer tensor, got {kept_positions.dtype} "
                         f"{tuple(kept_positions.shape)}")
    if kept_positions.numel() > 1 and not bool((kept_positions[1:] > kept_positions[:-1]).all()):
        raise ValueError("kept_positions must be strictly increasing")
    if int(kept_positions[0]) < 0:
        raise ValueError("kept_positions must be >= 0")


def _check_assignment(assignment: torch.Tensor, n_kept: int) -> None:
    if assignment.ndim != 1 or assignment.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"assignment must be a 1-D integer tensor, got {assignment.dtype} {tuple(assignment.shape)}")
    if assignment.numel() and not (int(assignment.min()) >= -1 and int(assignment.max()) < n_kept):
        raise ValueError(f"assignment entries must be kept indices in [0, {n_kept}) or -1 (dropped)")


def _span_edges(kept_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c,) bool masks of the kept tokens that start and that end a span of consecutive positions."""
    _check_kept_positions(kept_positions)
    gap = kept_positions[1:] - kept_positions[:-1] != 1
    edge = torch.ones(1, dtype=torch.bool, device=kept_positions.device)
    return torch.cat([edge, gap]), torch.cat([gap, edge])


def _spans(kept_positions: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) position of each span of consecutive kept positions."""
    starts, ends = _span_edges(kept_positions)
    return list(zip(kept_positions[starts].tolist(), kept_positions[ends].tolist()))


def _figure(size: tuple[float, float]):
    # NOTE: an explicit Agg canvas instead of pyplot: no global backend switch, no figure registry to leak.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _save(figure, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
