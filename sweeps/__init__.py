"""The sweep service's driver side: the YAML config and its validation (``config``), the search space
(``space``), what each stage runs besides the sampler's proposals (``stages``: promotions from screening, the
test stage's presses), and the driver (``driver``), a small loop over a pool of Ray workers (``worker_pool``)
and the ledgers that keep the state directory, MLflow and Optuna in step, one per stage (``state``); the ``grkv``
command line (``cli``) and what it shares with the driver's entry point ``sweep.py`` (``entry_points``)."""
