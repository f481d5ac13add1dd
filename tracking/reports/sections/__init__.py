"""The report's sections, one module a section kind: each turns an analysis (``tracking.reports.analyses``) into
the lines, tables and figures of one ``Section``, writing its files through a ``TableWriter``.

- ``words``: the sentences several sections say alike (ties, directions, which samples);
- ``losses``: loss against performance, and screening;
- ``resources``: efficiency, memory and iso-resource trade-offs;
- ``ablation``, ``significance``, ``depth``: the ablation table, the paired tests, the needle depth;
- ``importances``: the rebuilt Optuna study's importances and history.
"""
