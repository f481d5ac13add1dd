"""The knobs of a sweep's report, which its analyses and sections read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReportOptions:
    """Knobs of the analyses.

    Attributes
    ----------
    score : str
        The child metric compared first across configurations (its direction from ``HIGHER_IS_BETTER``); the
        answer metrics the runs logged are compared after it.
    ttft_tolerance : float
        Relative TTFT gap still "approximately equal prefill" in the iso-prefill comparison.
    bootstrap_resamples : int
        Resamples of the paired bootstrap (the paper uses 100,000).
    seed : int
        Seed of the bootstrap.
    """

    score: str = "mean_score"
    ttft_tolerance: float = 0.10
    bootstrap_resamples: int = 100_000
    seed: int = 0
