"""The paper's analyses over a sweep's runs: loss vs performance, screening, iso-resource comparisons, ablations,
significance, the score per needle depth; one module an analysis kind.

Performance is the score and the answer metrics, which see what the binary score ties on (``PERFORMANCE_METRICS``);
every metric's direction comes from ``grkv_core.metrics.HIGHER_IS_BETTER`` (``higher_is_better``).

Each function takes a :class:`~tracking.reports.data.SweepRuns` and returns tables (pandas) plus the
numbers the summary quotes; figures and files are made elsewhere. Every analysis uses the full-stage runs
(scored on the tuning samples) unless its docstring says otherwise: screening runs have no score, and the
held-out test stage is kept for the comparisons that decide (budgets and significance).

- ``metrics``: which metrics judge a configuration, their directions, per-sample rows;
- ``anchors``: the runs comparisons are anchored on (eviction only, the paper default, the best trial);
- ``loss_performance``, ``screening``: reconstruction losses against performance;
- ``resources``: iso-memory, budgets, iso-prefill and cost trade-offs;
- ``ablation``: the paper's ablation table;
- ``significance``: paired tests against eviction only, and the sweep's held-out finding;
- ``depth_window``: the score per needle depth, the always-kept window apart.
"""
