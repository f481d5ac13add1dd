"""The sweep service's worker side: the Ray actor that holds a loaded model and evaluates batches of trials on it
(``trial_worker``), answering the typed requests of ``protocol``; and the vocabulary the whole service shares
(``names``: MLflow tags, Optuna attributes, stages; ``protocol``: ``TrialRequest``/``TrialOutcome``).

NOTE: imports nothing of ``tracking``, which logs what the workers return and so imports their vocabulary (a test
checks the direction)."""
