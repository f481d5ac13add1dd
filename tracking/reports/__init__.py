"""Reports of a GRKV sweep, built only from its MLflow runs (issue "Reports from MLflow").

``build_report`` runs everything; the pieces are importable on their own: ``load_sweep`` (runs of each
stage -> DataFrames), the statistics (``pareto_front``, ``paired_bootstrap_ci``, ``sign_flip_test``,
``compare_configs``, ``correlate``), the analyses and the rebuilt Optuna study.
"""

from tracking.reports.analyses import (
    ablation_table,
    budget_points,
    iso_resource,
    loss_performance,
    screening,
    significance,
    tidy_sample_scores,
    tidy_task_scores,
    trade_off,
)
from tracking.reports.data import SweepNotFoundError, SweepRuns, load_sweep
from tracking.reports.optuna_study import param_importances, rebuild_study
from tracking.reports.report import Report, ReportOptions, build_report
from tracking.reports.stats import (
    BootstrapCI,
    Correlation,
    PairedComparison,
    compare_configs,
    correlate,
    paired_bootstrap_ci,
    pareto_front,
    sign_flip_test,
)

__all__ = [
    "BootstrapCI", "Correlation", "PairedComparison", "Report", "ReportOptions", "SweepNotFoundError", "SweepRuns",
    "ablation_table", "budget_points", "build_report", "compare_configs", "correlate", "iso_resource", "load_sweep",
    "loss_performance", "paired_bootstrap_ci", "param_importances", "pareto_front", "rebuild_study", "screening",
    "sign_flip_test", "significance", "tidy_sample_scores", "tidy_task_scores", "trade_off",
]
