"""Diagnostics of merge maps: numerics, plots and the report that runs them on samples live apart.

- ``carriers``: carrier concentration of a local merge (paper App. A, App. B).
- ``windows``: window summaries and their cross-window consistency (paper Sec. 3.2, App. C).
- ``plots``: the paper's merge map and cross-window consistency heatmap as PNG files; the only module that
  imports matplotlib.
- ``carrier_report``: ``grkv analyze``, the carrier concentration of eviction presses on real prefills, and its
  plots.

An evaluation's reconstruction losses are measured by ``grkv_core.evaluation.probe``.
"""
