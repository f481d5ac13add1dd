"""The sweep service's worker side: the Ray actor that holds a loaded model and evaluates batches of trials on it
(``trial_worker``), answering the typed requests of ``service.protocol``.

NOTE: imports nothing of ``tracking``: both sides share ``service`` instead (a test checks it)."""
