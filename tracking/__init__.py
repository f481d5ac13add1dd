"""MLflow logging of sweeps (``mlflow_tracker``: one parent run per sweep, one child run per trial) and the
reports built from those runs alone (``reports``, the ``grkv report`` command).

NOTE: imports nothing of ``workers``: the outcomes it logs are ``workers.protocol``'s (a test checks it)."""
