"""The sweep service's shared vocabulary: what ``workers``, ``tracking`` and ``sweeps`` all name.

- ``names``: MLflow tags, Optuna user attributes, stage names, the recommended press file's name, the baselines;
- ``protocol``: the typed ``TrialRequest`` and ``TrialOutcome`` crossing the Ray boundary between the driver and its
  workers, which the tracker logs.

NOTE: imports nothing of ``workers``, ``tracking`` or ``sweeps`` (a test checks it), so the worker side and the
MLflow side each depend on this package and never on each other.
"""
