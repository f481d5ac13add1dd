"""From an Optuna trial to a press configuration (define-by-run, so the space can be conditional)."""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from dataclasses import replace

import optuna

from grkv_core.catalog import merger_option_specs
from grkv_core.config import PressConfig
from grkv_core.options import GRKV_DEFAULTS, GRKV_PRESETS, PAPER_GRKV_OPTIONS
from sweeps.config import SweepConfig
from sweeps.params import CategoricalParam, FloatParam, IntParam, can_fix
from workers.names import (
    BASELINE_TAG,
    BASELINES,
    BUDGET_PARAMS,
    DESIGN_ROW_ATTR,
    EVICTION_ONLY,
    LIBRARY_DEFAULT,
    PAPER_DEFAULT,
    ZERO_SUFFIX,
)

# Each preset where it departs from GRKVPress's defaults (the paper's Alg. 1: ``"paper"``).
PRESETS_OFF_DEFAULT = {
    preset: {name: value for name, value in options.items() if value != GRKV_DEFAULTS[name]}
    for preset, options in GRKV_PRESETS.items()
}

# NOTE: an exact zero is its own categorical switch (``name + ZERO_SUFFIX``), so log-uniform ranges stay valid
# and TPE can learn "no ridge" as a separate mode (the paper's lambda = 0 ablation).


def suggest_press(trial: optuna.Trial, config: SweepConfig) -> PressConfig:
    """Ask ``trial`` for every searched value and return the press configuration it describes.

    NOTE: the eviction-only baseline (user attribute ``BASELINE_TAG``) is a fixed reference, not a point of the
    search space: it is the eviction press alone at the sweep's budget whatever the merge choices. The paper-default
    baseline runs the paper's Alg. 1 (``PAPER_GRKV_OPTIONS``): the searched options at the values it was enqueued
    with (``baseline_params``), every other option at the paper's value; so do the rows of a ``one_at_a_time``
    design, which change one factor from it. The library-default baseline is ``GRKVPress``'s defaults. Every other
    trial takes the sweep's ``preset`` for the options it does not search (``GRKVPress``'s defaults without one).
    """
    space = dict(config.search_space)
    budget = {name: _suggest(trial, name, space.pop(name)) for name in BUDGET_PARAMS if name in space}
    if trial.user_attrs.get(BASELINE_TAG) == EVICTION_ONLY:
        return config.sweep_press(**budget)
    merge = trial.suggest_categorical("merge", config.merge)
    # NOTE: each searched option reaches the mergers that take it (GRKV's window_size is CaM's too); the others
    # keep their defaults, and the sampler is not asked for what the chosen merger does not read.
    taken = merger_option_specs(merge)
    options = {name: _suggest(trial, name, param) for name, param in space.items() if name in taken}
    baseline = trial.user_attrs.get(BASELINE_TAG)
    if baseline == PAPER_DEFAULT or DESIGN_ROW_ATTR in trial.user_attrs:
        options = {**PRESETS_OFF_DEFAULT["paper"], **options}
    elif config.preset and merge == "grkv" and baseline != LIBRARY_DEFAULT:
        options = {**PRESETS_OFF_DEFAULT[config.preset], **options}
    return replace(config.sweep_press(merge, **budget), merge_options=options)


def press_of(params: dict, config: SweepConfig, user_attrs: dict | None = None) -> PressConfig:
    """The press configuration a trial ran, from its parameters and user attributes (``FrozenTrial.params``,
    ``.user_attrs``)."""
    trial = optuna.trial.FixedTrial(params)
    for name, value in (user_attrs or {}).items():
        trial.set_user_attr(name, value)
    return suggest_press(trial, config)


def _suggest(trial: optuna.Trial, name: str, param):
    if isinstance(param, FloatParam):
        if param.include_zero and trial.suggest_categorical(name + ZERO_SUFFIX, [False, True]):
            return 0.0
        return trial.suggest_float(name, param.low, param.high, log=param.log)
    if isinstance(param, IntParam):
        return trial.suggest_int(name, param.low, param.high, log=param.log)
    return trial.suggest_categorical(name, param.choices)


def baseline_params(config: SweepConfig) -> list[tuple[str, dict]]:
    """The trials enqueued first, as ``(name, params)`` (the driver tags each with its name): the paper's Alg. 1
    behind the press (here its values of the searched options; ``suggest_press`` adds the others), the press
    alone (named, not proposed: see ``suggest_press``; in a bounded-cache sweep also at each other searched target
    size) and GRKVPress's defaults behind the press (the library's
    default, where a sweep starts); each at the sweep's budget (``press.compression_ratio``, or a bounded cache's
    ``press.target_size`` and ``compression_interval``), also when it is searched.
    A searched parameter that cannot propose a baseline's value (a categorical one without it among its choices,
    e.g. ``null`` for no cap) is left to the sampler, with a warning."""
    budget = {}
    for name in BUDGET_PARAMS:
        if name in config.search_space:
            budget.update(_fixed(name, config.search_space[name], getattr(config.press, name)))
    baselines = []
    for baseline in (name for name in BASELINES if name in config.baselines):
        if baseline == EVICTION_ONLY:
            baselines.append((EVICTION_ONLY, budget))
            baselines += [(EVICTION_ONLY, {**budget, "target_size": size}) for size in _other_sizes(config)]
        elif "grkv" in config.merge:
            options = PAPER_GRKV_OPTIONS if baseline == PAPER_DEFAULT else GRKV_DEFAULTS
            baselines.append((baseline, {**budget, "merge": "grkv", **_searched_at(config, baseline, options)}))
    return baselines


def _other_sizes(config: SweepConfig) -> list[int]:
    """A bounded-cache sweep's searched target sizes (its choices) besides its own, where eviction-only runs too: every
    size a merger may be chosen at has eviction alone beside it (the iso-memory comparison)."""
    param = config.search_space.get("target_size")
    if not config.bounded or not isinstance(param, CategoricalParam):
        return []
    return [size for size in param.choices if size != config.press.target_size]


def _searched_at(config: SweepConfig, baseline: str, options: dict) -> dict:
    """The parameters that fix each searched option at its value in ``options`` (those that can propose it)."""
    params = {}
    for name, value in options.items():
        param = config.search_space.get(name)
        if param is None:
            continue
        if not can_fix(param, value):
            warnings.warn(
                f"{baseline} {name}={value!r} cannot be proposed by the searched {param.type} parameter; "
                "left to the sampler"
            )
            continue
        params.update(_fixed(name, param, value))
    return params


def one_at_a_time_params(config: SweepConfig) -> list[dict]:
    """The rows of a ``one_at_a_time`` design as trial parameters: the paper default's with one factor changed
    (``SweepConfig.one_at_a_time_rows``); none for another sampler."""
    if config.sampler.type != "one_at_a_time":
        return []
    paper = dict(baseline_params(config))[PAPER_DEFAULT]
    rows = []
    for changes in config.one_at_a_time_rows():
        params = dict(paper)
        for name, value in changes.items():
            params.update(_fixed(name, config.search_space[name], value))
        rows.append(params)
    return rows


def _fixed(name: str, param, value) -> dict:
    """The parameters that make ``_suggest`` return ``value`` for ``name`` (with its exact-zero switch)."""
    if isinstance(param, FloatParam) and param.include_zero:
        return {name + ZERO_SUFFIX: True} if value == 0 else {name: value, name + ZERO_SUFFIX: False}
    return {name: value}


# NOTE: a sampler that keeps proposing configurations already evaluated (TPE on a choice without parameters, such
# as ``merge: none``, once it scores best) is stuck, not done: after this many duplicates in a row the proposals
# are drawn at random until one is new (``proposing_at_random``).
RANDOM_AFTER_DUPLICATES = 10


@contextlib.contextmanager
def proposing_at_random(study: optuna.Study, seed: int):
    """Within the block, ``study`` asks and suggests with a ``RandomSampler`` seeded with ``seed``; its own sampler
    (and that sampler's state) is back afterwards. A grid is left as it is: it never proposes a point twice."""
    sampler = study.sampler
    if not isinstance(sampler, optuna.samplers.GridSampler):
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    try:
        yield
    finally:
        study.sampler = sampler


@contextlib.contextmanager
def trials_read_once(study: optuna.Study):
    """Within the block, every read of the study's trials by this thread is answered from one read of its storage, the
    first.

    NOTE: for the sampler's reads while one trial is asked for and suggested: ``Study.ask`` reads the study two or three
    times, and TPE with a constant liar reads it afresh for each parameter (Optuna caches the finished trials, but reads
    the unfinished ones from the database each time: several round trips a read). The answer is the same every time:
    only the lease holder writes the study; the trial being asked for is created after the first read and the sampler
    leaves it out of what it reads; and a trial another thread of the driver tells meanwhile (``sweeps.state.writer``)
    is one a read a moment earlier would have shown running (tests/test_sweep_scaling.py checks the proposals are the
    same). Other threads read the storage as before.
    """
    storage = study._storage
    overridden = "get_all_trials" in vars(storage)
    read = storage.get_all_trials
    reader = threading.get_ident()
    first: list | None = None

    def get_all_trials(study_id, deepcopy=True, states=None):
        nonlocal first
        if threading.get_ident() != reader:
            return read(study_id, deepcopy=deepcopy, states=states)
        if first is None:
            first = read(study_id, deepcopy=False)
        trials = first if states is None else [trial for trial in first if trial.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    storage.get_all_trials = get_all_trials
    try:
        yield
    finally:
        if overridden:
            storage.get_all_trials = read
        else:
            del storage.get_all_trials


def make_sampler(config: SweepConfig, seed: int) -> optuna.samplers.BaseSampler:
    """The configured sampler, seeded with ``seed`` (each of a sweep's studies has its own)."""
    sampler = config.sampler
    if sampler.type == "tpe":
        # NOTE: a worker's batch asks for several trials before any is told; the constant liar counts the
        # running ones as bad, so they differ.
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=sampler.n_startup_trials, multivariate=True, constant_liar=True
        )
    if sampler.type == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if sampler.type == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=sampler.n_startup_trials)
    if sampler.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler.type == "one_at_a_time":
        # NOTE: every trial of the design is enqueued and ``trials`` counts exactly them, so nothing is sampled.
        return optuna.samplers.RandomSampler(seed=seed)
    grid = {name: param.choices for name, param in config.search_space.items()}
    grid["merge"] = config.merge
    return optuna.samplers.GridSampler(grid, seed=seed)
