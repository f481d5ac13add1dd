"""The sweep service's driver side: the YAML config and its validation (``config``), the search space
(``space``), and the driver (``driver``), a small loop over a pool of Ray workers (``worker_pool``) and the
trial ledger that keeps the state directory, MLflow and Optuna in step (``ledger``)."""
