"""Single-process evaluation: kvpress's question-answering protocol, the trial engine, the metrics and the files.

- ``generation``: the protocol (prompts, prefill, one question answered on a cache);
- ``shared_prefill``, ``batched_decoding``: the trial engine: one prefill compresses a sample for many presses
  (kvpress compresses after each layer's attention, so the forward does not depend on the press) and caches of
  one budget answer the questions as one batch, with the results of one press at a time;
- ``answer_metrics``, ``probe``: the reference answer teacher-forced on each cache (NLL, KL, top-1) and the window,
  held-out and question reconstruction losses;
- ``evaluator``: ``Evaluator.evaluate_trials``, several presses on one sample, with or without decoding;
- ``results``: ``SampleResult``, ``summarize``, the resumable result file and the comparison table;
- ``run``: an evaluation config end to end (``run_evaluation``, ``run_evaluations``, ``EvaluationSetup``);
- ``kvpress_layout``: results in kvpress's evaluation layout, written and read back.

NOTE: this package imports nothing itself, so the light ``kvpress_layout`` stays light for the sweep service.
"""
