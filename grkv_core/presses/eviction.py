"""The eviction presses the catalog builds from more than a budget (``grkv_core.catalog.EVICTION_PRESSES``)."""

from __future__ import annotations

from kvpress import AdaKVPress, CriticalAdaKVPress, CriticalKVPress, SnapKVPress

from grkv_core.options import PAPER_WINDOW

# NOTE: the paper pairs GRKV with SnapKV's 32-token observation window and pooling kernel 5 (Sec. 4.1, "as in
# prior KV-cache eviction methods"; the authors' code: window 32, kernel 5), so SnapKV and the presses built
# on it (CriticalKV, AdaKV, CriticalAdaKV) use it here instead of kvpress's window of 64. The paper gives no
# window for PyramidKV, which keeps kvpress's default.
PAPER_SNAPKV_WINDOW = dict(window_size=PAPER_WINDOW, kernel_size=5)


def snapkv(compression_ratio: float) -> SnapKVPress:
    return SnapKVPress(compression_ratio=compression_ratio, **PAPER_SNAPKV_WINDOW)


def criticalkv(compression_ratio: float) -> CriticalKVPress:
    return CriticalKVPress(snapkv(compression_ratio))


def adakv(compression_ratio: float) -> AdaKVPress:
    return AdaKVPress(snapkv(compression_ratio))


def criticaladakv(compression_ratio: float) -> CriticalAdaKVPress:
    return CriticalAdaKVPress(snapkv(compression_ratio))
