"""Merging presses: kvpress presses that keep any eviction press's tokens and merge the evicted ones into them.

- ``selection``: the base press's decision (kept positions, scores) as data, without evicting anything.
- ``merging``: ``BaseMergerPress``, the base of every merging press, which owns the ``compress`` template.
- ``grkv``: ``GRKVPress``, global ridge regression of the kept keys and values (the paper's method).
- ``local_merging``: ``LocalMergePress`` and ``MergeInputs``, what the local baselines share; one baseline per
  file: ``cam`` (CaM), ``d2o`` (D2O), ``asymkv`` (AsymKV), ``kvmerger`` (KVMerger).
"""

from grkv_core.presses.asymkv import AsymKVPress
from grkv_core.presses.cam import CaMPress
from grkv_core.presses.d2o import D2OPress
from grkv_core.presses.grkv import GRKVPress
from grkv_core.presses.kvmerger import KVMergerPress
from grkv_core.presses.local_merging import LocalMergePress, MergeInputs
from grkv_core.presses.merging import BaseMergerPress

__all__ = ["AsymKVPress", "CaMPress", "D2OPress", "GRKVPress", "KVMergerPress", "LocalMergePress", "MergeInputs",
           "BaseMergerPress"]
