"""An in-memory Optuna study rebuilt from the sweep's MLflow runs, for importances and history plots.

The rebuilt study needs no access to the sweep's Optuna storage (journal file or database): the trial
params are the child runs' params, the values their objective metrics, and the distributions come from
the sweep config on the parent run (``search_space.*``), or are inferred from the values seen.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import optuna
import pandas as pd
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.importance import BaseImportanceEvaluator

from tracking.reports.data import Objective, SweepRuns
from workers.names import BASELINE_TAG, METHOD_ATTR, RUN_ID_ATTR, SAMPLER_PREFIX, TRIAL_TAG, ZERO_SUFFIX

# PED-ANOVA's authors advise at least this many trials in the top quantile it contrasts with the rest.
MIN_TOP_TRIALS = 5


@dataclass
class RebuiltStudy:
    """The study, the objectives its values follow, and what had to be inferred or skipped."""

    study: optuna.Study
    objectives: list[Objective]
    notes: list[str] = field(default_factory=list)

    def history(self) -> pd.DataFrame:
        """``trial_number`` (the sweep's own numbering), ``baseline``, ``method`` and one column per objective."""
        rows = [
            {
                "trial_number": t.user_attrs[TRIAL_TAG],
                "baseline": t.user_attrs.get(BASELINE_TAG),
                "method": t.user_attrs[METHOD_ATTR],
                **{o.metric: value for o, value in zip(self.objectives, t.values)},
            }
            for t in self.study.trials
        ]
        return pd.DataFrame(rows)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _from_search_space(spec: dict) -> BaseDistribution | None:
    kind = spec.get("type")
    if kind == "float":
        return FloatDistribution(float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)))
    if kind == "int":
        return IntDistribution(int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)))
    if kind == "categorical" and spec.get("choices"):
        return CategoricalDistribution(spec["choices"])
    return None


def _from_values(values: pd.Series) -> BaseDistribution:
    plain = [_plain(v) for v in values]
    if all(isinstance(v, bool) for v in plain):
        return CategoricalDistribution((False, True))
    if all(isinstance(v, (int, float)) for v in plain):
        if all(float(v).is_integer() for v in plain):
            return IntDistribution(int(min(plain)), int(max(plain)))
        return FloatDistribution(float(min(plain)), float(max(plain)))
    return CategoricalDistribution(sorted({str(v) for v in plain}))


def _covering(distribution: BaseDistribution, values: pd.Series) -> BaseDistribution:
    """Widen ``distribution`` to hold every observed value (an enqueued baseline may lie outside)."""
    plain = [_plain(v) for v in values]
    if isinstance(distribution, CategoricalDistribution):
        extra = [v for v in dict.fromkeys(plain) if v not in distribution.choices]
        return CategoricalDistribution(list(distribution.choices) + extra) if extra else distribution
    low, high = min([distribution.low, *plain]), max([distribution.high, *plain])
    if (low, high) == (distribution.low, distribution.high):
        return distribution
    if isinstance(distribution, IntDistribution):
        return IntDistribution(int(low), int(high), log=distribution.log)
    return FloatDistribution(float(low), float(high), log=distribution.log and low > 0)


def infer_distributions(runs: SweepRuns) -> tuple[dict[str, BaseDistribution], list[str]]:
    """One Optuna distribution per trial param, and notes on those not taken from the sweep config."""
    space, notes, distributions = runs.search_space, [], {}
    for name in runs.param_names:
        column = SAMPLER_PREFIX + name
        values = runs.trials[column].dropna() if column in runs.trials else pd.Series(dtype=object)
        if name == "merge":
            declared = CategoricalDistribution(runs.merge_choices)
        elif name.endswith(ZERO_SUFFIX):
            declared = CategoricalDistribution((False, True))
        else:
            declared = _from_search_space(space.get(name, {}))
        if declared is None:
            if values.empty:
                continue
            declared = _from_values(values)
            notes.append(f"distribution of {name!r} inferred from its values (not in the sweep's search_space)")
        covering = _covering(declared, values)
        if covering is not declared:
            notes.append(f"distribution of {name!r} widened to hold values outside the declared search space")
        distributions[name] = covering
    return distributions, notes


def _param_value(distribution: BaseDistribution, value):
    value = _plain(value)
    if isinstance(distribution, CategoricalDistribution):
        # A column with missing values turns 32 into 32.0; hand Optuna the declared choice itself.
        return next(choice for choice in distribution.choices if choice == value)
    if isinstance(distribution, IntDistribution):
        return int(value)
    return float(value)


def rebuild_study(runs: SweepRuns) -> RebuiltStudy:
    """A fresh in-memory study holding one COMPLETE trial per finished run, in trial-number order."""
    objectives = runs.objectives
    distributions, notes = infer_distributions(runs)
    study = optuna.create_study(
        study_name=runs.sweep_id,
        storage=optuna.storages.InMemoryStorage(),
        directions=[o.direction for o in objectives],
    )
    for _, row in runs.trials.sort_values("trial_number").iterrows():
        values = [row.get(o.metric, np.nan) for o in objectives]
        if not np.all(np.isfinite(np.asarray(values, dtype=float))):
            notes.append(f"trial {int(row['trial_number'])} lacks an objective metric; left out of the study")
            continue
        proposed = {name: row.get(SAMPLER_PREFIX + name) for name in distributions}
        params = {
            name: _param_value(distributions[name], value)
            for name, value in proposed.items()
            if value is not None and pd.notna(value)
        }
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={name: distributions[name] for name in params},
                values=[float(v) for v in values],
                user_attrs={
                    TRIAL_TAG: int(row["trial_number"]),
                    RUN_ID_ATTR: row["run_id"],
                    METHOD_ATTR: row["method"],
                    BASELINE_TAG: row["baseline"] if isinstance(row["baseline"], str) else None,
                },
            )
        )
    return RebuiltStudy(study, objectives, notes)


@dataclass
class Importance:
    """Hyperparameter importances for one objective; empty with a ``note`` when none could be computed."""

    objective: Objective
    evaluator: str
    importances: dict[str, float]
    note: str = ""


def _evaluators(n_trials: int) -> list[tuple[str, Callable[[], BaseImportanceEvaluator]]]:
    quantile = min(max(0.1, MIN_TOP_TRIALS / n_trials), 0.5)
    name = f"PED-ANOVA (top {quantile:.0%} vs all)"
    if math.ceil(quantile * n_trials) < MIN_TOP_TRIALS:
        name += f", only {math.ceil(quantile * n_trials)} top trials: indicative"
    candidates = [(name, lambda: optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile))]
    # NOTE: fANOVA and mean decrease impurity both fit sklearn forests; sklearn is not a dependency.
    if importlib.util.find_spec("sklearn") is not None:
        candidates.append(
            (
                "mean decrease impurity (random forest)",
                lambda: optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0),
            )
        )
    return candidates


def param_importances(rebuilt: RebuiltStudy) -> list[Importance]:
    """Importances per objective: PED-ANOVA, else mean decrease impurity when sklearn is installed.

    An evaluator that fails (too few trials, a degenerate space) hands over to the next; the result
    says which one produced the numbers, or why there are none.
    """
    study = rebuilt.study
    n_trials = len(study.trials)
    results = []
    for index, objective in enumerate(rebuilt.objectives):
        if n_trials < 2:
            results.append(Importance(objective, "none", {}, f"{n_trials} completed trial(s): no importances"))
            continue
        # PED-ANOVA reads a target as "lower is better"; a single objective keeps the study's direction.
        sign = -1.0 if objective.maximize else 1.0
        target = None if len(rebuilt.objectives) == 1 else (lambda t, i=index, s=sign: s * t.values[i])
        failures = []
        for name, make in _evaluators(n_trials):
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    importances = optuna.importance.get_param_importances(study, evaluator=make(), target=target)
            except Exception as error:  # noqa: BLE001 - any evaluator failure hands over to the next one
                failures.append(f"{name} failed: {type(error).__name__}: {error}")
                continue
            messages = [str(w.message) for w in caught if "low `target` values" not in str(w.message)]
            note = "; ".join(failures + messages)
            results.append(Importance(objective, name, dict(importances), note))
            break
        else:
            failures.append(
                "fANOVA and mean decrease impurity need scikit-learn, which is not installed"
                if importlib.util.find_spec("sklearn") is None
                else "no evaluator left"
            )
            results.append(Importance(objective, "none", {}, "; ".join(failures)))
    return results
