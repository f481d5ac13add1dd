"""kvpress's ``PerLayerCompressionPress``, which also takes a merger."""

from __future__ import annotations

from dataclasses import dataclass

import kvpress
from kvpress import BasePress

from grkv_core.presses.merging import BaseMergerPress


@dataclass
class PerLayerCompressionPress(kvpress.PerLayerCompressionPress):
    """A compression ratio per layer around a kvpress ``ScorerPress`` or a merger.

    kvpress's wrapper sets its press's ``compression_ratio`` to each layer's ratio and runs the press's own hook; it
    asserts that the press is a ``ScorerPress``, the kind of press whose ``compression_ratio`` is its budget. A
    merger is no ``ScorerPress`` (it has no scores, and kvpress's wrappers that read scores must refuse it), yet its
    ``compression_ratio`` is its budget (its base press's), which is all this wrapper sets: so a merger is taken here,
    and any other press meets kvpress's checks. Unlike kvpress's wrapper, this one forwards the model set-up
    (``post_init_from_model``) to its press, as kvpress's other wrappers do: a merger is set up for the model it
    compresses (``GRKVPress``'s ``merged_layers``).

    NOTE: a subclass, so that whatever recognises kvpress's wrapper (a merger's base press, ``select_tokens``)
    recognises this one; kvpress's own wrapper refuses a merger when built.

    Parameters
    ----------
    press : BasePress
        A kvpress ``ScorerPress`` or a merger (``BaseMergerPress``).
    compression_ratios : list of float
        One ratio per layer of the model, each in [0, 1], as in kvpress.
    """

    press: BasePress

    def __post_init__(self) -> None:
        if not isinstance(self.press, BaseMergerPress):
            super().__post_init__()

    def post_init_from_model(self, model) -> None:
        self.press.post_init_from_model(model)
