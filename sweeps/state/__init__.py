"""The sweep's state: where every trial's fate is written, always in the same order.

A finished trial goes first to the sweep's state directory (atomically), then to MLflow, then to Optuna. Only
the driver writes the Optuna storage. On a restart with the same sweep id, each ledger walks that chain
(``reconcile``), so nothing finished is redone and nothing is logged twice; a trial that was interrupted is
re-enqueued once.

- ``state_dir``: the driver's own record of finished trials, one JSON file each, and where the rest lives;
- ``optuna_storage``: the Optuna storage, a journal file in the state directory (repaired after a torn write)
  or a database URL, opened with a one-line error when it cannot be;
- ``rdb_storage``: the database storage, its calls retried through an outage of up to ``storage.outage_s``, what
  only the lease holder can have written read back from memory;
- ``records``: what every stage writes through (``SweepRecords``: state directory, Optuna storage, MLflow parent
  run, service overhead) and what the driver asks of a stage's ledger (``StageLedger``);
- ``ledgers``: one ledger a stage, a ``TrialLedger`` for an Optuna stage (the screening study or the main
  study), a ``HeldOutLedger`` for the held-out test stage;
- ``writer``: the threads that write a trial's MLflow run and Optuna tell, in order, after the driver has written
  its outcome to the state directory, while the driver goes on;
- ``driver_times``: the driver's seconds per trial by part, on its loop and on its writer.
"""
