"""The paper's diagnostic figures as PNG files: the KV merge map (Fig. 1, App. B) and the cross-window
consistency heatmap (Fig. 2, App. C).

NOTE: the only diagnostics module that imports matplotlib, and only when a figure is drawn.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from grkv_core.diagnostics.carriers import check_assignment, check_kept_positions, kept_spans


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
    check_kept_positions(kept_positions)
    kept_positions = kept_positions.cpu().long()
    if int(kept_positions[-1]) >= length:
        raise ValueError(f"kept positions must lie in [0, {length})")
    kept_mask = torch.zeros(length, dtype=torch.bool)
    kept_mask[kept_positions] = True
    evicted_positions = (~kept_mask).nonzero()[:, 0]
    if assignment.shape != evicted_positions.shape:
        raise ValueError(
            f"assignment must have one entry per evicted token ({evicted_positions.numel()}), "
            f"got shape {tuple(assignment.shape)}"
        )
    assignment = assignment.cpu()
    check_assignment(assignment, kept_positions.numel())
    merged = assignment >= 0
    carrier_positions = kept_positions[assignment[merged]]
    sources = evicted_positions[merged]
    unit_keys = torch.nn.functional.normalize(keys.detach().float().cpu(), dim=-1)
    similarity = (unit_keys[sources] * unit_keys[carrier_positions]).sum(-1)

    figure, axes = _figure((7.0, 6.0))
    points = axes.scatter(
        carrier_positions.numpy(),
        sources.numpy(),
        c=similarity.numpy(),
        cmap="viridis",
        s=8,
        vmin=min(0.0, float(similarity.min())) if similarity.numel() else 0.0,
        vmax=1.0,
    )
    figure.colorbar(points, ax=axes, label="key cosine similarity (evicted, carrier)")
    axes.plot([0, length - 1], [0, length - 1], linestyle="--", color="grey", linewidth=0.8)
    spans = kept_spans(kept_positions)
    axes.broken_barh(
        [(start, stop - start + 1) for start, stop in spans],
        (0.0, 0.025),
        transform=axes.get_xaxis_transform(),
        color="black",
    )
    axes.set_xlim(-0.5, length - 0.5)
    axes.set_ylim(-0.5, length - 0.5)
    axes.set_xlabel("retained (carrier) token index")
    axes.set_ylabel("evicted token index")
    axes.set_title(title or f"KV merge map: {int(merged.sum())} evicted -> {kept_positions.numel()} retained")
    return _save(figure, path)


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
    image = axes.imshow(
        similarity.numpy(),
        cmap="magma",
        vmin=min(float(similarity.min()), 1.0 - 1e-3),
        vmax=1.0,
        origin="upper",
        interpolation="nearest",
    )
    figure.colorbar(image, ax=axes, label="cos(s_Wu, s_Wv)")
    if prompt_windows is not None:
        for draw in (axes.axvline, axes.axhline):
            draw(prompt_windows - 0.5, color="cyan", linewidth=1.2)
    axes.set_xlabel("window v")
    axes.set_ylabel("window u")
    axes.set_title(title or f"cross-window consistency, {n_windows} windows")
    return _save(figure, path)


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
