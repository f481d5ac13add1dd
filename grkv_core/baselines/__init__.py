"""Merging baselines as kvpress presses wrapping any eviction press: CaM, D2O, AsymKV, KVMerger."""

from grkv_core.baselines.asymkv import AsymKVPress
from grkv_core.baselines.cam import CaMPress
from grkv_core.baselines.common import LocalMergePress, MergeInputs
from grkv_core.baselines.d2o import D2OPress
from grkv_core.baselines.kvmerger import KVMergerPress

__all__ = ["AsymKVPress", "CaMPress", "D2OPress", "KVMergerPress", "LocalMergePress", "MergeInputs"]
