"""Every metric an evaluation records, defined once as a ``MetricSpec``: its family, its direction, how an evaluation's
summary holds it, and whether a sweep may optimise or screen on it; the metric tuples are views of the table.

NOTE: imports nothing heavy, like ``grkv_core.config``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Metric families: the dataset's scorer, the reference answer teacher-forced on each cache
# (``grkv_core.evaluation.answer_metrics``), the reconstruction discrepancies (``grkv_core.evaluation.probe``), long
# text streamed through a bounded cache (``grkv_core.evaluation.streaming``) and what a press costs (time, memory,
# sizes).
BENCHMARK, ANSWER, RECONSTRUCTION, STREAM, COST = "benchmark", "answer", "reconstruction", "stream", "cost"
# How an evaluation's summary (``grkv_core.evaluation.results.summarize``) holds a per-sample metric: the mean over
# the samples that have a value (under its ``costs``), or per task the mean over its samples, then the mean over
# the tasks (a sample's ``score``: the summary's ``tasks``, ``mean_score`` and ``mean_score_outside_window``).
SAMPLE_MEAN, TASK_MEAN = "sample_mean", "task_mean"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name, what it measures and how it is used.

    ``family`` is one of ``BENCHMARK``, ``ANSWER``, ``RECONSTRUCTION``, ``COST``. ``summary`` is how an evaluation's
    summary holds a per-sample metric (``SAMPLE_MEAN`` or ``TASK_MEAN``); None for a number the summary computes
    from the samples' scores. ``higher_is_better`` is its direction (else smaller is better). ``objective``: a sweep
    may optimise it; ``screening``: a screening stage may rank configurations by it (it needs no decoding).
    """

    name: str
    family: str
    help: str
    summary: str | None = SAMPLE_MEAN
    higher_is_better: bool = False
    objective: bool = False
    screening: bool = False


# Every metric, defined once; the tuples below are views of this table (a test holds them to it).
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("score", BENCHMARK, "a sample's mean score over its questions, 0-1", TASK_MEAN, higher_is_better=True),
    MetricSpec(
        "mean_score",
        BENCHMARK,
        "the mean over tasks of each task's mean sample score, 0-100",
        None,
        higher_is_better=True,
        objective=True,
    ),
    MetricSpec(
        "mean_score_outside_window",
        BENCHMARK,
        "mean_score over the samples whose answer lies outside the "
        "press's always-kept window (those inside score at any budget)",
        None,
        higher_is_better=True,
    ),
    MetricSpec(
        "answer_nll",
        ANSWER,
        "the reference answer's mean token NLL on the compressed cache (nats)",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "answer_kl",
        ANSWER,
        "the mean KL(full || compressed) over the reference answer's positions (nats)",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "answer_top1",
        ANSWER,
        "the fraction of the reference answer's positions whose top-1 token agrees with the full cache's",
        higher_is_better=True,
        objective=True,
    ),
    MetricSpec(
        "window_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the surrogate window's queries",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "heldout_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the first generated tokens' queries (needs decoding)",
        objective=True,
    ),
    MetricSpec(
        "question_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the question's own queries, teacher-forced on its reference answer",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "stream_nll",
        STREAM,
        "the mean NLL of every token of a long text streamed through the bounded cache (nats; protocol stream_nll)",
        objective=True,
    ),
    MetricSpec(
        "ttft_s",
        COST,
        "time to first token: the prefill with its compression, plus the first question (s)",
        objective=True,
    ),
    MetricSpec("prefill_s", COST, "the prefill with this press's compression (s)"),
    MetricSpec("decode_ms_per_token", COST, "decoding latency per generated token (ms)", objective=True),
    MetricSpec("kv_bytes", COST, "the bytes the compressed cache keeps", objective=True),
    MetricSpec("full_kv_bytes", COST, "the bytes of the full cache"),
    MetricSpec(
        "peak_memory_bytes", COST, "peak memory: the CUDA allocator's, or on the CPU the process's high-water mark"
    ),
    MetricSpec("wall_s", COST, "the sample's wall time, shared among the presses evaluated with it (s)"),
    MetricSpec("context_tokens", COST, "the prefill's length (tokens)"),
)
# The per-sample metrics whose mean over the samples an evaluation's summary holds under ``costs`` (a bounded-cache
# evaluation's summary holds its own, ``STREAM_METRICS``, the same way).
SAMPLE_MEAN_METRICS = tuple(spec.name for spec in METRICS if spec.summary == SAMPLE_MEAN and spec.family != STREAM)
LOSS_METRICS = tuple(spec.name for spec in METRICS if spec.family == RECONSTRUCTION)
ANSWER_METRICS = tuple(spec.name for spec in METRICS if spec.family == ANSWER)
STREAM_METRICS = tuple(spec.name for spec in METRICS if spec.family == STREAM)
# NOTE: a summary's per-task scores (``score.<task>``) are scores too.
HIGHER_IS_BETTER = frozenset(spec.name for spec in METRICS if spec.higher_is_better)
SCREENING_METRICS = tuple(spec.name for spec in METRICS if spec.screening)
OBJECTIVE_METRICS = tuple(spec.name for spec in METRICS if spec.objective)
