"""The sweep service's worker side: the typed trial request and outcome (``protocol``) and the Ray actor that
holds a loaded model and evaluates batches of trials on it (``trial_worker``)."""
