"""Diagnostics of a compressed cache and of merge maps; numerics and plots live apart.

- ``losses``: how far a compressed cache's attention outputs drift from the full cache's (the reconstruction
  discrepancy the evaluation records and GRKV's acceptance rule compares), and which full-cache positions
  an evicted cache kept. On the hot path: imports torch and the solver only.
- ``carriers``: carrier concentration of a local merge (paper App. A, App. B).
- ``windows``: window summaries and their cross-window consistency (paper Sec. 3.2, App. C).
- ``plots``: the paper's merge map and cross-window consistency heatmap as PNG files; the only module that
  imports matplotlib.
"""
