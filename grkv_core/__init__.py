"""GRKV: global-regression KV-cache merging behind any kvpress eviction press.

>>> from kvpress import SnapKVPress
>>> from grkv_core import GRKVPress
>>> with GRKVPress(SnapKVPress(compression_ratio=0.9))(model):
...     model.model(input_ids=context_ids, past_key_values=cache)

The configuration (``grkv_core.config``) imports nothing heavy, the solver alone (``grkv_core.solver.grkv_merge``)
needs only torch, and the press imports kvpress: each loads only when asked for.
"""

__version__ = "0.1.0"

__all__ = ["GRKVPress", "grkv_merge", "__version__"]


def __getattr__(name):
    # NOTE: lazy, so that importing any submodule (the light configuration above all) loads no torch or kvpress.
    if name == "GRKVPress":
        from grkv_core.presses.grkv import GRKVPress

        return GRKVPress
    if name == "grkv_merge":
        from grkv_core.solver.merge import grkv_merge

        return grkv_merge
    raise AttributeError(f"module 'grkv_core' has no attribute {name!r}")
