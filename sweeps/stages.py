"""What each stage of a sweep runs, besides the sampler's proposals: the screened configurations promoted to
full trials, and the held-out test stage's presses.

A sweep with ``screening.trials`` runs a screening study (``<sweep_id>.screen``, ranked by a reconstruction
loss, nothing generated) before the main study; its best configurations are enqueued in the main study right
after the baselines. A sweep with ``data.test.samples`` ends with a test stage on held-out samples: the main
study's best trials, the baselines, and eviction-only at larger budgets.
"""

from __future__ import annotations

import math

import optuna

from grkv_core.config import PressConfig
from sweeps.config import SweepConfig
from sweeps.space import press_of
from workers.names import BASELINE_TAG, EVICTION_ONLY, PROMOTED_FROM_TAG

SCREEN_STUDY_SUFFIX = ".screen"
# NOTE: the screening study's sampler is seeded apart from the main study's, so the main study's random
# start-up trials do not repeat the screened configurations it was not given.
SCREEN_SEED_OFFSET = 1

COMPLETE = optuna.trial.TrialState.COMPLETE


def promotions(screen: optuna.Study, count: int, min_distance: float = 0.0) -> list[tuple[dict, dict]]:
    """The ``count`` best distinct screened configurations (at least ``min_distance`` apart, see
    ``configuration_distance``), best first, as ``(params, user_attrs)`` to enqueue in the main study."""
    ranked = sorted(screen.get_trials(deepcopy=False, states=(COMPLETE,)), key=lambda t: (t.value, t.number))
    return [(trial.params, {PROMOTED_FROM_TAG: trial.number}) for trial in _distinct(ranked, min_distance)[:count]]


def best_trials(study: optuna.Study, config: SweepConfig) -> list[optuna.trial.FrozenTrial]:
    """The main study's best trials that are not baselines, at most ``test.top_k``: the best values for one
    objective, the Pareto set for several (ordered by the first objective), distinct configurations only (at least
    ``test.min_distance`` apart)."""
    candidates = [
        trial for trial in study.get_trials(deepcopy=False, states=(COMPLETE,)) if BASELINE_TAG not in trial.user_attrs
    ]
    costs = {trial.number: as_costs(trial.values, config.directions) for trial in candidates}
    if len(config.directions) > 1:
        candidates = [
            trial
            for trial in candidates
            if not any(dominates(costs[other.number], costs[trial.number]) for other in candidates)
        ]
    ranked = sorted(candidates, key=lambda trial: (costs[trial.number], trial.number))
    return _distinct(ranked, config.test.min_distance)[: config.test.top_k]


def presses_to_test(study: optuna.Study, config: SweepConfig) -> list[tuple[str, PressConfig]]:
    """The test stage, as ``(test_of, press)``: the best trials (``test_of`` their number), each baseline at
    the sweep's budget (its name), eviction-only at every ``test.eviction_ratios`` (``eviction_only@0.88``) or, for a
    bounded cache, every ``test.eviction_sizes`` (``eviction_only@1024``), and
    each of ``test.mergers`` with its defaults at the sweep's budget (its name, ``kvpress_merging``).

    NOTE: a baseline is tested with the press its full trial ran, so both stages compare the same methods.
    """
    presses = [
        (str(trial.number), press_of(trial.params, config, trial.user_attrs)) for trial in best_trials(study, config)
    ]
    trials = study.get_trials(deepcopy=False)
    for name in config.baselines:
        runs = sorted(
            (
                t
                for t in trials
                if t.user_attrs.get(BASELINE_TAG) == name and t.state != optuna.trial.TrialState.WAITING
            ),
            key=lambda t: (t.state != COMPLETE, t.number),
        )
        if runs:
            presses.append((name, press_of(runs[0].params, config, runs[0].user_attrs)))
    presses += [
        (f"{EVICTION_ONLY}@{ratio:g}", config.sweep_press(compression_ratio=ratio))
        for ratio in config.test.eviction_ratios
    ]
    presses += [
        (f"{EVICTION_ONLY}@{size}", config.sweep_press(target_size=size)) for size in config.test.eviction_sizes
    ]
    presses += [(merger, config.sweep_press(merger)) for merger in config.test.mergers]
    return presses


def configuration_distance(first: optuna.trial.FrozenTrial, second: optuna.trial.FrozenTrial) -> float:
    """How far apart two trials' configurations are, in [0, 1]: the largest difference over their parameters, each
    measured on its own range (a float or integer as a fraction of its range, on a log scale where it is searched
    log-uniformly; a categorical choice 0 when equal, else 1; a parameter only one of them has, 1).

    NOTE: 0 exactly when the parameters are equal, so a minimum distance of 0 keeps every configuration that is not
    a repeat.
    """
    distance = 0.0
    for name in first.params.keys() | second.params.keys():
        if name not in first.params or name not in second.params:
            return 1.0
        a, b = first.params[name], second.params[name]
        distribution = first.distributions[name]
        if isinstance(distribution, (optuna.distributions.FloatDistribution, optuna.distributions.IntDistribution)):
            scale = math.log if distribution.log else float
            width = scale(distribution.high) - scale(distribution.low)
            distance = max(distance, abs(scale(a) - scale(b)) / width if width > 0 else float(a != b))
        else:
            distance = max(distance, float(a != b))
    return distance


def _distinct(trials: list[optuna.trial.FrozenTrial], min_distance: float = 0.0) -> list[optuna.trial.FrozenTrial]:
    """``trials`` in order, leaving out each one closer than ``min_distance`` to (or a repeat of) one kept before."""
    kept = []
    for trial in trials:
        if all(trial.params != other.params and configuration_distance(trial, other) >= min_distance for other in kept):
            kept.append(trial)
    return kept


def as_costs(values: list[float], directions: list[str]) -> list[float]:
    """A trial's objective ``values`` as costs, lower better in every objective (``directions``: minimize or
    maximize, one each)."""
    return [value if direction == "minimize" else -value for direction, value in zip(directions, values)]


def dominates(costs: list[float], other: list[float]) -> bool:
    return all(a <= b for a, b in zip(costs, other)) and any(a < b for a, b in zip(costs, other))
