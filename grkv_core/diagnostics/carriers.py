"""Carrier concentration (paper App. A "Local KV Merging and Carrier Support", App. B "Quantitative Carrier
Concentration"): how a local merge's evicted -> carrier assignment spreads over the kept tokens."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch


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
    check_assignment(assignment, n_kept)
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
        raise ValueError(
            f"assignment {tuple(assignment.shape)} and kept_positions {tuple(kept_positions.shape)} "
            "must share their leading (unit) axes"
        )
    units = []
    for unit_assignment, unit_kept in zip(
        assignment.reshape(-1, assignment.shape[-1]), kept_positions.reshape(-1, kept_positions.shape[-1])
    ):
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


def check_kept_positions(kept_positions: torch.Tensor) -> None:
    if kept_positions.ndim != 1 or kept_positions.numel() == 0 or kept_positions.is_floating_point():
        raise ValueError(
            f"kept_positions must be a non-empty 1-D integer tensor, got {kept_positions.dtype} "
            f"{tuple(kept_positions.shape)}"
        )
    if kept_positions.numel() > 1 and not bool((kept_positions[1:] > kept_positions[:-1]).all()):
        raise ValueError("kept_positions must be strictly increasing")
    if int(kept_positions[0]) < 0:
        raise ValueError("kept_positions must be >= 0")


def check_assignment(assignment: torch.Tensor, n_kept: int) -> None:
    if assignment.ndim != 1 or assignment.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"assignment must be a 1-D integer tensor, got {assignment.dtype} {tuple(assignment.shape)}")
    if assignment.numel() and not (int(assignment.min()) >= -1 and int(assignment.max()) < n_kept):
        raise ValueError(f"assignment entries must be kept indices in [0, {n_kept}) or -1 (dropped)")


def _span_edges(kept_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c,) bool masks of the kept tokens that start and that end a span of consecutive positions."""
    check_kept_positions(kept_positions)
    gap = kept_positions[1:] - kept_positions[:-1] != 1
    edge = torch.ones(1, dtype=torch.bool, device=kept_positions.device)
    return torch.cat([edge, gap]), torch.cat([gap, edge])


def kept_spans(kept_positions: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) position of each span of consecutive kept positions."""
    starts, ends = _span_edges(kept_positions)
    return list(zip(kept_positions[starts].tolist(), kept_positions[ends].tolist()))
