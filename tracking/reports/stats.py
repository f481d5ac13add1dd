"""The statistics of the paper's analyses: correlations (pooled, and within each sample across configurations),
Pareto fronts, paired bootstrap and sign-flip tests.

Pure functions of numbers and tables, nothing about MLflow, so each can be checked on hand-made data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

# Up to this many units the sign-flip test enumerates all 2^n sign assignments (exact), beyond it samples them.
# NOTE: scipy enumerates them in Python, 65,536 in about half a second; 2^16 is also fewer than the 100,000 random
# assignments a sampled test draws by default, so an exact test never costs more than a sampled one.
MAX_EXACT_SIGN_FLIP_UNITS = 16
_RESAMPLE_BATCH = 8192  # resamples or assignments evaluated at once (bounds memory for thousands of units)


@dataclass(frozen=True)
class Correlation:
    """Pearson and Spearman correlation of ``y`` against ``x`` over ``n`` configurations.

    NaN coefficients come with a ``note`` saying why in words (too few points, which side is constant).
    """

    x: str
    y: str
    n: int
    pearson_r: float
    pearson_p: float
    spearman_rho: float
    spearman_p: float
    note: str = ""


def correlate(x: Sequence[float], y: Sequence[float], x_name: str = "x", y_name: str = "y") -> Correlation:
    """Pearson ``r`` and Spearman ``rho`` with their two-sided p-values (scipy.stats), NaN pairs dropped."""
    x_values, y_values = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x_values) & np.isfinite(y_values)
    x_values, y_values = x_values[keep], y_values[keep]
    n = int(keep.sum())
    nan = float("nan")
    if n < 3:
        return Correlation(x_name, y_name, n, nan, nan, nan, nan, note=f"only {n} configuration(s) with both values")
    constant = _constant_sides({x_name: x_values, y_name: y_values})
    if constant:
        return Correlation(x_name, y_name, n, nan, nan, nan, nan, note=f"{constant} over the {n} points")
    pearson = stats.pearsonr(x_values, y_values)
    spearman = stats.spearmanr(x_values, y_values)
    return Correlation(
        x_name,
        y_name,
        n,
        float(pearson.statistic),
        float(pearson.pvalue),
        float(spearman.statistic),
        float(spearman.pvalue),
    )


def _constant_sides(sides: dict[str, np.ndarray]) -> str:
    """In words, which of the named value arrays do not vary (``"mean_score is constant (27.1)"``); "" if none."""
    constant = [f"{name} is constant ({values[0]:.4g})" for name, values in sides.items() if np.ptp(values) == 0]
    return " and ".join(constant)


@dataclass(frozen=True)
class WithinSampleCorrelation:
    """Spearman ρ of ``y`` against ``x`` across configurations within each sample, summarised over the samples.

    A per-sample ρ is free of what makes one sample harder than another for every configuration (its needle's
    depth, its length), which a pooled correlation mixes in.

    Attributes
    ----------
    x, y : str
    samples : int
        Samples with a defined ρ: at least 3 configurations with both values, neither side constant.
    mean_rho, median_rho : float
        Over those samples (NaN when there are none).
    positive : int
        Of those samples, how many have ρ > 0.
    x_constant, y_constant : int
        Samples (with at least 3 configurations) on which that side takes one value across configurations.
    note : str
        Why no ρ is defined, in words, when ``samples`` is 0.
    """

    x: str
    y: str
    samples: int
    mean_rho: float
    median_rho: float
    positive: int
    x_constant: int
    y_constant: int
    note: str = ""


def within_sample_correlation(rows: pd.DataFrame, x: str, y: str, unit: str = "sample") -> WithinSampleCorrelation:
    """Spearman ρ of ``y`` against ``x`` within each ``unit``, over its rows (one per configuration).

    Parameters
    ----------
    rows : pandas.DataFrame
        One row per (configuration, unit), with the columns ``unit``, ``x`` and ``y``; NaN pairs dropped.
    x, y, unit : str
        Column names.
    """
    rhos, x_constant, y_constant = [], 0, 0
    for _, group in rows[[unit, x, y]].dropna().groupby(unit):
        if len(group) < 3:
            continue
        x_values, y_values = group[x].to_numpy(dtype=float), group[y].to_numpy(dtype=float)
        x_constant += int(np.ptp(x_values) == 0)
        y_constant += int(np.ptp(y_values) == 0)
        if np.ptp(x_values) > 0 and np.ptp(y_values) > 0:
            rhos.append(float(stats.spearmanr(x_values, y_values).statistic))
    values = np.asarray(rhos)
    note = ""
    if not rhos:
        constant = [
            f"{name} is constant within {count} sample(s)"
            for name, count in ((x, x_constant), (y, y_constant))
            if count
        ]
        note = " and ".join(constant) or "no sample has 3 configurations with both values"
    return WithinSampleCorrelation(
        x,
        y,
        len(rhos),
        float(values.mean()) if rhos else float("nan"),
        float(np.median(values)) if rhos else float("nan"),
        int((values > 0).sum()),
        x_constant,
        y_constant,
        note,
    )


def pareto_front(
    points: pd.DataFrame | Sequence[Mapping[str, float]], maximize: Sequence[str] = (), minimize: Sequence[str] = ()
) -> list[int]:
    """Positions of the non-dominated points.

    A point dominates another when it is at least as good in every objective and strictly better in
    one; equal points do not dominate each other, so duplicates on the front are all kept. Points with
    a missing (NaN) objective are never on the front.

    Parameters
    ----------
    points : pandas.DataFrame or sequence of mappings
        One row (mapping) per point, holding at least the objective keys.
    maximize, minimize : sequence of str
        The keys to maximise and to minimise.

    Returns
    -------
    list of int
        Row positions (0-based, ascending) of the Pareto-optimal points.
    """
    if not maximize and not minimize:
        raise ValueError("pareto_front needs at least one objective to maximize or minimize")
    table = points if isinstance(points, pd.DataFrame) else pd.DataFrame(list(points))
    if table.empty:
        return []
    # Negating the minimised objectives makes "larger is better" hold in every column.
    larger_is_better = np.column_stack(
        [table[key].to_numpy(dtype=float) for key in maximize] + [-table[key].to_numpy(dtype=float) for key in minimize]
    )
    valid = np.isfinite(larger_is_better).all(axis=1)
    candidates = larger_is_better[valid]
    at_least_as_good = (candidates[:, None, :] >= candidates[None, :, :]).all(axis=2)
    strictly_better = (candidates[:, None, :] > candidates[None, :, :]).any(axis=2)
    dominated = (at_least_as_good & strictly_better).any(axis=0)
    return [int(position) for position in np.flatnonzero(valid)[~dominated]]


@dataclass(frozen=True)
class BootstrapCI:
    """A percentile bootstrap confidence interval of the mean paired difference."""

    estimate: float
    low: float
    high: float
    confidence: float
    n_resamples: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def _differences(differences: Sequence[float]) -> np.ndarray:
    values = np.asarray(differences, dtype=float).ravel()
    if values.size == 0:
        raise ValueError("need at least one paired difference")
    if not np.isfinite(values).all():
        raise ValueError("paired differences must be finite")
    return values


def paired_bootstrap_ci(
    differences: Sequence[float], n_resamples: int = 100_000, confidence: float = 0.95, seed: int | None = 0
) -> BootstrapCI:
    """Percentile bootstrap CI of the mean of paired differences (per task, the paper's App. G, or per sample).

    ``scipy.stats.bootstrap`` with the percentile method; a single difference is its own interval (every resample
    of one unit is that unit).

    Parameters
    ----------
    differences : sequence of float
        One difference per unit (treatment minus control, each averaged over seeds).
    n_resamples : int
        Bootstrap resamples of the units, with replacement.
    confidence : float
        Two-sided coverage, in (0, 1).
    seed : int or None
        Seed of the resampling generator (None: fresh entropy).
    """
    values = _differences(differences)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    estimate = float(values.mean())
    if values.size == 1:  # NOTE: scipy refuses a single observation
        return BootstrapCI(estimate, estimate, estimate, confidence, n_resamples)
    interval = stats.bootstrap(
        (values,),
        np.mean,
        n_resamples=n_resamples,
        batch=_RESAMPLE_BATCH,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    ).confidence_interval
    return BootstrapCI(estimate, float(interval.low), float(interval.high), confidence, n_resamples)


def sign_flip_test(differences: Sequence[float], n_resamples: int | None = None, seed: int | None = 0) -> float:
    """Two-sided paired sign-flip (permutation) test of a zero mean difference.

    Under the null each unit's difference is as likely to have either sign, so the p-value is the fraction of sign
    assignments whose ``|mean|`` is at least the observed one: ``scipy.stats.permutation_test`` over the paired
    differences (``permutation_type="samples"`` flips their signs). Up to ``MAX_EXACT_SIGN_FLIP_UNITS`` units all
    ``2**T`` assignments are enumerated (exact); beyond, with ``n_resamples`` given, that many random assignments
    estimate it as ``(1 + hits) / (1 + n_resamples)`` (never 0, so a valid p-value).

    Parameters
    ----------
    differences : sequence of float
        One paired difference per unit (task or test sample).
    n_resamples : int, optional
        Random sign assignments when there are too many units to enumerate; None refuses such input.
    seed : int or None
        Seed of the random assignments (unused by the exact test).

    Returns
    -------
    float
        The p-value; exact tests give a multiple of ``2**-T`` (at least ``2 / 2**T`` unless every
        difference is 0).
    """
    values = _differences(differences)
    exact = values.size <= MAX_EXACT_SIGN_FLIP_UNITS
    if not exact and n_resamples is None:
        raise ValueError(
            f"an exact sign-flip test over {values.size} units enumerates 2^{values.size} assignments; "
            f"at most {MAX_EXACT_SIGN_FLIP_UNITS} units are supported without n_resamples"
        )
    # The same sum reached in a different order can differ in its last bits: a mean within this of 0 counts as 0,
    # so a zero observed mean ties with every assignment that cancels out too (scipy's own tolerance is relative).
    floor = 1e-9 * np.abs(values).mean()

    def absolute_mean(signed: np.ndarray, axis: int) -> np.ndarray:
        return np.maximum(np.abs(signed.mean(axis=axis)), floor)

    # NOTE: |mean| with alternative="greater" is the two-sided test of a null distribution symmetric about 0; scipy
    # enumerates every assignment when asked for at least 2^T of them.
    result = stats.permutation_test(
        (values,),
        absolute_mean,
        permutation_type="samples",
        vectorized=True,
        n_resamples=2**values.size if exact else n_resamples,
        batch=_RESAMPLE_BATCH,
        alternative="greater",
        rng=np.random.default_rng(seed),
    )
    return float(result.pvalue)


@dataclass(frozen=True)
class PairedComparison:
    """Treatment vs control over the same units and seeds (the paper's Table "multiseed").

    The paired unit is a task (the paper's) or a held-out test sample (``unit`` names it). ``*_mean``/``*_sd``
    are the mean and sample standard deviation across seeds of the unit-averaged score; ``gain``, ``ci`` and
    ``p_value`` are over unit-level differences averaged over seeds; ``p_exact`` tells whether the sign-flip
    p-value enumerated every sign assignment or sampled them. ``metric`` names what was compared and
    ``higher_is_better`` its direction, which ``better_units``, ``better_seeds`` and ``verdict`` follow.
    """

    treatment: str
    control: str
    unit: str
    seeds: tuple
    units: tuple[str, ...]
    differences: tuple[float, ...]
    treatment_mean: float
    treatment_sd: float
    control_mean: float
    control_sd: float
    ci: BootstrapCI
    p_value: float
    p_exact: bool
    better_units: int
    better_seeds: int
    metric: str = "score"
    higher_is_better: bool = True

    @property
    def gain(self) -> float:
        """The mean paired difference, treatment minus control (not sign-flipped for lower-is-better metrics)."""
        return self.ci.estimate

    @property
    def tied(self) -> bool:
        """Every paired unit scores the same under both configurations: the CI is [0, 0] and says nothing."""
        return not any(self.differences)

    @property
    def verdict(self) -> str:
        """The treatment ``better`` or ``worse`` (in the metric's direction) when the CI excludes 0, else
        ``no significant difference``."""
        if not self.ci.excludes_zero():
            return "no significant difference"
        return "better" if (self.gain > 0) == self.higher_is_better else "worse"


def compare_configs(
    tidy: pd.DataFrame,
    treatment: str,
    control: str,
    *,
    unit: str = "task",
    metric: str = "score",
    higher_is_better: bool = True,
    n_resamples: int = 100_000,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> PairedComparison:
    """Compare two configurations across seeds and paired units, as in the paper's multi-seed evaluation.

    Each unit is averaged over seeds; the unit-level differences get a paired bootstrap CI and a sign-flip
    p-value (exact up to ``MAX_EXACT_SIGN_FLIP_UNITS`` units, else from ``n_resamples`` random assignments).
    Only (seed, unit) cells scored for both configurations are used.

    Parameters
    ----------
    tidy : pandas.DataFrame
        Columns ``config``, ``seed``, ``unit`` (the name given) and ``metric``; repeated cells are averaged.
    treatment, control : str
        Values of ``config`` to compare (e.g. ``paper_default`` and ``eviction_only``).
    unit : str
        The column that pairs the scores: ``task`` (the paper's) or e.g. ``sample`` (held-out test samples).
    metric : str
        The column compared (``score``, or e.g. ``answer_nll``).
    higher_is_better : bool
        The metric's direction (``grkv_core.metrics.HIGHER_IS_BETTER``): which sign of a difference is better.
    n_resamples, confidence, seed
        Passed to :func:`paired_bootstrap_ci` (and to :func:`sign_flip_test` beyond the exact size).
    """
    cells = tidy.groupby(["config", "seed", unit])[metric].mean()
    missing = [name for name in (treatment, control) if name not in cells.index.get_level_values("config")]
    if missing:
        raise KeyError(f"no scores for configuration(s) {missing}")
    paired = pd.concat({"treatment": cells.loc[treatment], "control": cells.loc[control]}, axis=1).dropna()
    if paired.empty:
        raise ValueError(f"{treatment!r} and {control!r} share no (seed, {unit}) cell")
    per_seed = paired.groupby(level="seed").mean()
    per_unit = paired.groupby(level=unit).mean()
    differences = (per_unit["treatment"] - per_unit["control"]).to_numpy()
    sign = 1.0 if higher_is_better else -1.0  # NOTE: better means sign * (treatment - control) > 0
    return PairedComparison(
        treatment=treatment,
        control=control,
        unit=unit,
        seeds=tuple(per_seed.index),
        units=tuple(per_unit.index),
        differences=tuple(float(d) for d in differences),
        treatment_mean=float(per_seed["treatment"].mean()),
        treatment_sd=float(per_seed["treatment"].std(ddof=1)),
        control_mean=float(per_seed["control"].mean()),
        control_sd=float(per_seed["control"].std(ddof=1)),
        ci=paired_bootstrap_ci(differences, n_resamples=n_resamples, confidence=confidence, seed=seed),
        p_value=sign_flip_test(differences, n_resamples=n_resamples, seed=seed),
        p_exact=len(differences) <= MAX_EXACT_SIGN_FLIP_UNITS,
        better_units=int((sign * differences > 0).sum()),
        better_seeds=int((sign * (per_seed["treatment"] - per_seed["control"]) > 0).sum()),
        metric=metric,
        higher_is_better=higher_is_better,
    )
