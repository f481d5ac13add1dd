"""Text labels placed on a laid-out figure so that no two overlap: each is measured, and kept only where it fits."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# Where a point's label may go, in order: right above, right below, left above, left below the point (its offset
# in points, then its horizontal and vertical alignment).
SIDES = (((4, 3), "left", "bottom"), ((4, -3), "left", "top"), ((-4, 3), "right", "bottom"), ((-4, -3), "right", "top"))


def thin_ticks(axis, renderer) -> None:
    """Drop, left to right, each tick of ``axis`` (an x axis) whose label would overlap a kept tick's label.

    Parameters
    ----------
    axis : matplotlib.axis.XAxis
        A drawn axis with fixed ticks and labels.
    renderer : matplotlib.backend_bases.RendererBase
        The renderer that drew it, to measure the labels with.
    """
    ticks = sorted(
        zip(axis.get_ticklocs(), axis.get_ticklabels()), key=lambda tick: tick[1].get_window_extent(renderer).x0
    )
    kept, taken = [], []
    for location, label in ticks:
        box = label.get_window_extent(renderer)
        if not any(box.overlaps(other) for other in taken):
            kept.append((location, label.get_text()))
            taken.append(box)
    axis.set_ticks([location for location, _ in kept], [text for _, text in kept])


def label_points(ax, labels: Iterable[tuple[str, float, float]], renderer, **text) -> None:
    """Each label beside its point, on the first of ``SIDES`` where it stays inside ``ax`` and overlaps no label
    placed before it; a label with no such side is left out (a point without coordinates too).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        A drawn axes whose position the figure keeps (no layout engine left to move it).
    labels : iterable of (str, float, float)
        Text and the point's data coordinates, most important first: the first ones get the free places.
    renderer : matplotlib.backend_bases.RendererBase
        The renderer that drew ``ax``, to measure the labels with.
    **text
        Properties of the labels' text (``fontsize``, ``color``).
    """
    area = ax.get_window_extent(renderer)
    taken = []
    for content, x, y in labels:
        if not (np.isfinite(x) and np.isfinite(y)):
            continue
        for offset, horizontal, vertical in SIDES:
            note = ax.annotate(
                content, (x, y), xytext=offset, textcoords="offset points", ha=horizontal, va=vertical, **text
            )
            box = note.get_window_extent(renderer)
            # Inside the axes it can overlap no tick label, title or legend either.
            if all(area.contains(*corner) for corner in box.corners()) and not any(box.overlaps(o) for o in taken):
                taken.append(box)
                break
            note.remove()
