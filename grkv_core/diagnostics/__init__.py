"""Diagnostics of a compressed cache and of merge maps; numerics and plots live apart.

- ``probe``: the window, held-out and question reconstruction losses of an evaluation (the losses themselves are
  the solver's, ``grkv_core.solver.losses``).
- ``carriers``: carrier concentration of a local merge (paper App. A, App. B).
- ``windows``: window summaries and their cross-window consistency (paper Sec. 3.2, App. C).
- ``plots``: the paper's merge map and cross-window consistency heatmap as PNG files; the only module that
  imports matplotlib.
"""
