"""The Optuna section: the study rebuilt from the MLflow runs, its hyperparameter importances and history."""

from __future__ import annotations

import pandas as pd

from tracking.reports import figures
from tracking.reports.data import SweepRuns
from tracking.reports.optuna_study import Importance, param_importances, rebuild_study
from tracking.reports.render import Section, TableWriter, formatted
from workers.names import TRIAL_TAG


def optuna_section(runs: SweepRuns, colors: dict[str, str], writer: TableWriter) -> Section:
    rebuilt = rebuild_study(runs)
    importances = param_importances(rebuilt)
    section = Section(
        "Optuna: hyperparameter importances and optimisation history",
        lines=[
            f"In-memory study rebuilt from {len(rebuilt.study.trials)} MLflow run(s); the Optuna storage is not read.",
            *rebuilt.notes,
            *[_importance_line(i) for i in importances],
        ],
    )
    if len(rebuilt.objectives) > 1:
        objectives = ", ".join(f"{o.metric} {o.direction}" for o in rebuilt.objectives)
        front = sorted(t.user_attrs[TRIAL_TAG] for t in rebuilt.study.best_trials)
        section.lines.append(f"Pareto-optimal trials over ({objectives}): {', '.join(map(str, front))}")
    table = pd.DataFrame(
        [
            {"objective": i.objective.metric, "evaluator": i.evaluator, "param": name, "importance": value}
            for i in importances
            for name, value in i.importances.items()
        ],
        columns=["objective", "evaluator", "param", "importance"],
    )
    writer.table("param_importances", table, formatted(table, {"importance": "{:.3f}"}))
    section.tables.append(("Importances", formatted(table, {"importance": "{:.3f}"})))
    section.figures.append(figures.importance_figure(importances, writer.path("param_importances.png")))
    if rebuilt.study.trials:
        section.figures.append(figures.history_figure(rebuilt, colors, writer.path("optimization_history.png")))
    return section


def _importance_line(importance: Importance, top: int = 3) -> str:
    ranked = ", ".join(f"{name} {value:.2f}" for name, value in list(importance.importances.items())[:top])
    line = f"Importances for {importance.objective.metric} ({importance.evaluator})"
    return line + (f": {ranked}" if ranked else "") + (f" — {importance.note}" if importance.note else "")
