"""GRKV: global-regression KV-cache merging behind any kvpress eviction press.

>>> from kvpress import SnapKVPress
>>> from grkv_core import GRKVPress
>>> with GRKVPress(SnapKVPress(compression_ratio=0.9))(model):
...     model.model(input_ids=context_ids, past_key_values=cache)

While decoding, a cache kept bounded, merged: ``MergingDecodingPress(GRKVPress(SnapKVPress()), target_size=512,
compression_interval=128)``. Each head's kept rows only, for head-adaptive presses (AdaKV):
``PerHeadCachePress(GRKVPress(AdaKVPress(SnapKVPress())))``. A press by name or from a press file:
``build_press("snapkv", 0.9, "grkv")``, ``press_from_file("press.yaml")``.

The catalog of names (``grkv_core.catalog``) and the configurations (``grkv_core.config``) import nothing heavy, the
solver alone (``grkv_core.solver.grkv_merge``) needs only torch, and the presses import kvpress: each loads only when
asked for.
"""

__version__ = "0.1.0"

__all__ = [
    "GRKVPress",
    "MergingDecodingPress",
    "PerHeadCachePress",
    "build_press",
    "grkv_merge",
    "press_from_file",
    "__version__",
]

# Where each public name is defined, imported on first use.
_PUBLIC = {
    "GRKVPress": "grkv_core.presses.grkv",
    "MergingDecodingPress": "grkv_core.presses.decoding",
    "PerHeadCachePress": "grkv_core.presses.per_head_cache",
    "build_press": "grkv_core.presses.from_config",
    "press_from_file": "grkv_core.presses.from_config",
    "grkv_merge": "grkv_core.solver.merge",
}


def __getattr__(name):
    # NOTE: lazy, so that importing any submodule (the light configuration above all) loads no torch or kvpress.
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grkv_core' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
