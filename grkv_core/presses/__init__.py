"""Merging presses: kvpress presses that keep any eviction press's tokens and merge the evicted ones into them.

- ``selection``: the base press's decision (kept positions, scores) as data, without evicting anything.
- ``merging``: ``BaseMergerPress``, the base of every merging press, which owns the ``compress`` template.
- ``decoding``: ``MergingDecodingPress``, a cache kept bounded while the model decodes, any merger behind it.
- ``per_head_cache``: ``PerHeadCachePress``, any press's cache with each head's kept rows only (``grkv_core.cache``).
- ``per_layer``: ``PerLayerCompressionPress``, kvpress's compression ratio per layer, around a merger too.
- ``grkv``: ``GRKVPress``, global ridge regression of the kept keys and values (the paper's method).
- ``local_merging``: ``LocalMergePress`` and ``MergeInputs``, what the local baselines share; one baseline per
  file: ``cam`` (CaM), ``d2o`` (D2O), ``asymkv`` (AsymKV), ``kvmerger`` (KVMerger).
- ``sliding_layers``: every press leaves a model's sliding-window layers whole (``compressing``).
- ``layer_groups``, ``surrogate_capture``, ``update_rules``: GRKV's batched solves, the query rows captured from the
  forward, and acceptance rules.
- ``query_policies``: GRKV's surrogate queries, one ``QueryPolicy`` per file (``grkv_core.catalog.QUERY_POLICIES``).
"""

import logging

from grkv_core.presses.asymkv import AsymKVPress
from grkv_core.presses.cam import CaMPress
from grkv_core.presses.d2o import D2OPress
from grkv_core.presses.decoding import MergingDecodingPress
from grkv_core.presses.grkv import GRKVPress
from grkv_core.presses.kvmerger import KVMergerPress
from grkv_core.presses.local_merging import LocalMergePress, MergeInputs
from grkv_core.presses.merging import BaseMergerPress
from grkv_core.presses.per_head_cache import PerHeadCachePress
from grkv_core.presses.per_layer import PerLayerCompressionPress
from grkv_core.presses.sliding_layers import compressing


class _OncePerMessage(logging.Filter):
    """kvpress logs "Model ... not tested" at every entry of a press (thousands of lines in a sweep on Gemma 3):
    each distinct message passes once per process."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


logging.getLogger("kvpress.presses.base_press").addFilter(_OncePerMessage())

__all__ = [
    "AsymKVPress",
    "CaMPress",
    "D2OPress",
    "MergingDecodingPress",
    "GRKVPress",
    "KVMergerPress",
    "LocalMergePress",
    "MergeInputs",
    "BaseMergerPress",
    "PerHeadCachePress",
    "PerLayerCompressionPress",
    "compressing",
]
