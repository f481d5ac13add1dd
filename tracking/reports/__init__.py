"""Reports of a GRKV sweep, built only from its MLflow runs (issue "Reports from MLflow").

``build_report`` runs everything; the pieces are importable on their own: ``load_sweep`` (runs of each
stage -> DataFrames), the statistics (``pareto_front``, ``paired_bootstrap_ci``, ``sign_flip_test``,
``compare_configs``, ``correlate``, ``within_sample_correlation``), the analyses, the rebuilt Optuna study, and
``finding``: the sweep's held-out result in one sentence.
"""

from tracking.reports.analyses.ablation import ablation_table
from tracking.reports.analyses.depth_window import depth_window
from tracking.reports.analyses.loss_performance import loss_performance
from tracking.reports.analyses.metrics import sample_table
from tracking.reports.analyses.resources import budget_points, iso_resource, trade_off
from tracking.reports.analyses.screening import screening
from tracking.reports.analyses.significance import (
    held_out_finding,
    significance,
    tidy_sample_scores,
    tidy_task_scores,
    tuned_winner,
)
from tracking.reports.data import SweepNotFoundError, SweepRuns, load_sweep
from tracking.reports.options import ReportOptions
from tracking.reports.optuna_study import param_importances, rebuild_study
from tracking.reports.report import Report, build_report
from tracking.reports.stats import (
    BootstrapCI,
    Correlation,
    PairedComparison,
    WithinSampleCorrelation,
    compare_configs,
    correlate,
    paired_bootstrap_ci,
    pareto_front,
    sign_flip_test,
    within_sample_correlation,
)
from tracking.reports.summary import finding

__all__ = [
    "BootstrapCI",
    "Correlation",
    "PairedComparison",
    "Report",
    "ReportOptions",
    "SweepNotFoundError",
    "SweepRuns",
    "WithinSampleCorrelation",
    "ablation_table",
    "budget_points",
    "build_report",
    "compare_configs",
    "correlate",
    "depth_window",
    "finding",
    "held_out_finding",
    "iso_resource",
    "load_sweep",
    "loss_performance",
    "paired_bootstrap_ci",
    "param_importances",
    "pareto_front",
    "rebuild_study",
    "sample_table",
    "screening",
    "sign_flip_test",
    "significance",
    "tidy_sample_scores",
    "tidy_task_scores",
    "trade_off",
    "tuned_winner",
    "within_sample_correlation",
]
