"""GRKV: global-regression KV-cache merging behind any kvpress eviction press.

>>> from kvpress import SnapKVPress
>>> from grkv_core import GRKVPress
>>> with GRKVPress(SnapKVPress(compression_ratio=0.9))(model):
...     model.model(input_ids=context_ids, past_key_values=cache)

The solver alone (``grkv_core.solver.grkv_merge``) needs only torch; the rest imports kvpress lazily.
"""

__version__ = "0.1.0"

from grkv_core.solver import grkv_merge  # noqa: E402

__all__ = ["GRKVPress", "grkv_merge", "__version__"]


def __getattr__(name):
    # NOTE: kvpress (and so transformers) load only when the press is asked for, keeping the solver light.
    if name == "GRKVPress":
        from grkv_core.press import GRKVPress

        return GRKVPress
    raise AttributeError(f"module 'grkv_core' has no attribute {name!r}")
