"""The sentences several sections say alike: a metric that ties, a metric's direction, which samples a stage
scored."""

from __future__ import annotations

from grkv_core.metrics import ANSWER_METRICS
from tracking.reports.analyses.metrics import higher_is_better
from tracking.reports.data import SweepRuns
from workers.names import TEST_STAGE


def tie_line(metric: str, where: str) -> str:
    """The one line said of a metric that ties ``where``, pointing to the continuous answer metrics."""
    others = ", ".join(name for name in ANSWER_METRICS if name != metric)
    return (
        f"{metric} ties {where}, so it cannot tell these configurations apart (no correlation, interval or "
        f"p-value on it means anything); the continuous answer metrics ({others}) can."
    )


def direction(metric: str) -> str:
    """``higher is better`` or ``lower is better``, from ``higher_is_better``."""
    return "higher is better" if higher_is_better(metric) else "lower is better"


def stage_words(runs: SweepRuns, stage: str) -> str:
    """Which samples a stage's results were scored on, in words."""
    if stage == TEST_STAGE:
        return f"held-out test stage, {runs.test_sample_count} samples"
    return "tuning samples; the best at each budget is selected on them"
