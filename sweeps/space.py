"""From an Optuna trial to a press configuration (define-by-run, so the space can be conditional)."""

from __future__ import annotations

import warnings

import optuna

from grkv_core.config import EVICTION_ONLY, PAPER_DEFAULT, PAPER_GRKV_OPTIONS, ZERO_SUFFIX, PressConfig, is_number
from sweeps.config import CategoricalParam, FloatParam, IntParam, SweepConfig

# NOTE: an exact zero is its own categorical switch (``name + ZERO_SUFFIX``), so log-uniform ranges stay valid
# and TPE can learn "no ridge" as a separate mode (the paper's lambda = 0 ablation).


def suggest_press(trial: optuna.Trial, config: SweepConfig) -> PressConfig:
    """Ask ``trial`` for every searched value and return the press configuration it describes."""
    space = dict(config.search_space)
    ratio_param = space.pop("compression_ratio", None)
    ratio = _suggest(trial, "compression_ratio", ratio_param) if ratio_param else config.press.compression_ratio
    merge = trial.suggest_categorical("merge", config.merge)
    options = {}
    if merge == "grkv":
        options = {name: _suggest(trial, name, param) for name, param in space.items()}
    return PressConfig(press=config.press.name, compression_ratio=ratio, merge=merge, merge_options=options)


def _suggest(trial: optuna.Trial, name: str, param):
    if isinstance(param, FloatParam):
        if param.include_zero and trial.suggest_categorical(name + ZERO_SUFFIX, [False, True]):
            return 0.0
        return trial.suggest_float(name, param.low, param.high, log=param.log)
    if isinstance(param, IntParam):
        return trial.suggest_int(name, param.low, param.high, log=param.log)
    return trial.suggest_categorical(name, param.choices)


def baseline_params(config: SweepConfig) -> list[tuple[str, dict]]:
    """The trials enqueued first: the paper's Alg. 1 behind the press (its options among the searched ones; a
    sweep that does not search an option runs GRKVPress's default), and the press alone."""
    baselines = []
    if PAPER_DEFAULT in config.baselines and "grkv" in config.merge:
        params = {"merge": "grkv"}
        for name, value in PAPER_GRKV_OPTIONS.items():
            param = config.search_space.get(name)
            if param is None:
                continue
            expressible = value in param.choices if isinstance(param, CategoricalParam) else is_number(value)
            if not expressible:
                warnings.warn(f"paper default {name}={value!r} cannot be proposed by the searched {param.type} "
                              "parameter; left to the sampler")
                continue
            params[name] = value
            if isinstance(param, FloatParam) and param.include_zero:
                params[name + ZERO_SUFFIX] = False
        baselines.append((PAPER_DEFAULT, params))
    if EVICTION_ONLY in config.baselines:
        baselines.append((EVICTION_ONLY, {"merge": "none"}))
    return baselines


def make_sampler(config: SweepConfig) -> optuna.samplers.BaseSampler:
    sampler = config.sampler
    if sampler.type == "tpe":
        return optuna.samplers.TPESampler(seed=sampler.seed, n_startup_trials=sampler.n_startup_trials,
                                          multivariate=True)
    if sampler.type == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=sampler.seed)
    if sampler.type == "gp":
        return optuna.samplers.GPSampler(seed=sampler.seed, n_startup_trials=sampler.n_startup_trials)
    if sampler.type == "random":
        return optuna.samplers.RandomSampler(seed=sampler.seed)
    grid = {name: param.choices for name, param in config.search_space.items()}
    grid["merge"] = config.merge
    return optuna.samplers.GridSampler(grid, seed=sampler.seed)
