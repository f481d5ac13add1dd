"""A sweep read back from MLflow alone: its parent run, and one row per finished trial.

Everything here comes from the tags, params and metrics that :mod:`tracking.mlflow_tracker` writes, so a
sweep can be reported while it runs, after it finished, or long after its Optuna storage is gone.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from grkv_core.config import BASELINE_TAG, PARENT_TAG, ROLE_TAG, SAMPLER_PREFIX, SWEEP_TAG, TRIAL_TAG

SCORE_PREFIX = "score."
_PAGE = 1000
_INTEGER = re.compile(r"[+-]?\d+")


class SweepNotFoundError(LookupError):
    """No parent run carries the sweep id (or the experiment named does not exist)."""


@dataclass(frozen=True)
class Objective:
    """One optimisation objective of the sweep: a child-run metric and its direction."""

    metric: str
    direction: str

    @property
    def maximize(self) -> bool:
        return self.direction == "maximize"


@dataclass
class SweepRuns:
    """The finished trials of one sweep, as logged in MLflow.

    Attributes
    ----------
    sweep_id, experiment_id, parent_run_id, parent_status : str
        Identity of the sweep's parent run and its current MLflow status (RUNNING while the sweep runs).
    parent_params : dict[str, str]
        The flattened sweep config (``press.name``, ``search_space.beta.low``, ``objectives``...).
    trials : pandas.DataFrame
        One row per FINISHED child run, ordered by trial number: ``run_id``, ``trial_number``,
        ``baseline`` (``paper_default``/``eviction_only`` or None), the press as it ran
        (``PressConfig.resolved()``: ``press``, ``compression_ratio``, ``merge``, every merger option such as
        ``lambda_k``, ``press.window_size``...; typed, NaN where a trial's press has no such field), the
        sampler's raw proposals as ``optuna.<name>``, every metric, every non-``mlflow.`` tag as ``tag.<key>``
        (``tag.grkv.status``...), and derived ``budget`` (= 1 - compression ratio), ``method`` (press, or
        press+merger) and ``configuration`` (baseline name or ``trial N``).
    param_names : list[str]
        The sampler's parameters, as Optuna named them (their values are the ``optuna.<name>`` columns).
    task_names : list[str]
        Tasks with a ``score.<task>`` metric.
    child_status_counts : dict[str, int]
        Status of every child run (FINISHED, RUNNING, FAILED, KILLED), finished or not.
    notes : list[str]
        Anything the loader had to decide (duplicate runs of a trial...).
    """

    sweep_id: str
    experiment_id: str
    parent_run_id: str
    parent_status: str
    parent_params: dict[str, str]
    trials: pd.DataFrame
    param_names: list[str]
    task_names: list[str]
    child_status_counts: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def press_name(self) -> str:
        return self.parent_params.get("press.name", "press")

    @property
    def objectives(self) -> list[Objective]:
        parsed = _json_or_none(self.parent_params.get("objectives"))
        if not parsed:
            return [Objective("mean_score", "maximize")]
        return [Objective(item["metric"], item["direction"]) for item in parsed]

    @property
    def merge_choices(self) -> list[str]:
        parsed = _json_or_none(self.parent_params.get("merge"))
        return list(parsed) if parsed else sorted(self.trials["merge"].dropna().unique())

    @property
    def search_space(self) -> dict[str, dict]:
        """``{param: {"type": ..., "low": ..., "high": ..., "log": ..., "choices": [...]}}`` from the parent."""
        space: dict[str, dict] = {}
        for key, text in self.parent_params.items():
            if key.startswith("search_space."):
                name, _, attribute = key.removeprefix("search_space.").rpartition(".")
                value = _json_or_none(text) if attribute == "choices" else parse_param(text)
                space.setdefault(name, {})[attribute] = value
        return space

    @property
    def data_seed(self) -> str:
        return self.parent_params.get("data.seed", "0")

    def baseline_trial(self, name: str, compression_ratio: float | None = None) -> pd.Series | None:
        """The trial enqueued as baseline ``name`` (at ``compression_ratio`` when given), or None."""
        rows = self.trials[self.trials["baseline"] == name]
        if compression_ratio is not None:
            rows = rows[np.isclose(rows["compression_ratio"], compression_ratio)]
        return rows.iloc[0] if len(rows) else None


def parse_param(text: str):
    """An MLflow param string back to bool, int, float or str (MLflow stores ``str(value)``)."""
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    if _INTEGER.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _json_or_none(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def search_all_runs(client: MlflowClient, experiment_ids: list[str], filter_string: str) -> list:
    """Every run matching ``filter_string``, following MLflow's pages (servers cap one page)."""
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string, run_view_type=ViewType.ACTIVE_ONLY,
                                  max_results=_PAGE, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _all_experiment_ids(client: MlflowClient) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(max_results=_PAGE, page_token=token)
        ids += [experiment.experiment_id for experiment in page]
        token = page.token
        if not token:
            return ids


def find_parent_run(client: MlflowClient, sweep_id: str, experiment: str | None = None):
    """The sweep's parent run (tags ``grkv.sweep_id`` and ``grkv.role = sweep``).

    Raises
    ------
    SweepNotFoundError
        No such experiment, no such sweep, or the same sweep id in several experiments.
    """
    if "'" in sweep_id:
        raise SweepNotFoundError(f"sweep id {sweep_id!r} contains a quote; sweep ids never do")
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise SweepNotFoundError(f"experiment {experiment!r} does not exist")
        experiment_ids, where = [found.experiment_id], f"experiment {experiment!r}"
    else:
        experiment_ids, where = _all_experiment_ids(client), "any experiment"
    parents = search_all_runs(client, experiment_ids,
                              f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'")
    if not parents:
        raise SweepNotFoundError(f"sweep {sweep_id!r} not found in {where} (no run tagged "
                                 f"{SWEEP_TAG}={sweep_id}, {ROLE_TAG}=sweep)")
    if len({run.info.experiment_id for run in parents}) > 1:
        raise SweepNotFoundError(f"sweep {sweep_id!r} exists in several experiments; name one with --experiment")
    return parents[0]


def load_sweep(client: MlflowClient, sweep_id: str, experiment: str | None = None) -> SweepRuns:
    """Read a sweep, finished or running, from MLflow into a :class:`SweepRuns`.

    Parameters
    ----------
    client : mlflow.tracking.MlflowClient
        A client of the tracking store the sweep logged to.
    sweep_id : str
        The sweep's id (the ``grkv.sweep_id`` tag).
    experiment : str, optional
        Look only in this experiment (default: every active experiment).
    """
    parent = find_parent_run(client, sweep_id, experiment)
    parent_id = parent.info.run_id
    children = [run for run in search_all_runs(
        client, [parent.info.experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'trial'")
        if run.data.tags.get(PARENT_TAG) == parent_id]
    notes = []
    finished = [run for run in children if run.info.status == "FINISHED"]
    by_number: dict[int, object] = {}
    for run in finished:
        number = int(run.data.tags[TRIAL_TAG])
        if number in by_number:
            notes.append(f"trial {number} has several FINISHED runs; the latest is used")
        if number not in by_number or run.info.end_time > by_number[number].info.end_time:
            by_number[number] = run
    param_names = sorted({name.removeprefix(SAMPLER_PREFIX) for run in by_number.values()
                          for name in run.data.params if name.startswith(SAMPLER_PREFIX)})
    rows = [_trial_row(run) for _, run in sorted(by_number.items())]
    trials = pd.DataFrame(rows) if rows else pd.DataFrame(columns=["run_id", "trial_number", "baseline", "merge"])
    trials = _with_derived_columns(trials)
    task_names = sorted(column.removeprefix(SCORE_PREFIX) for column in trials.columns
                        if column.startswith(SCORE_PREFIX))
    return SweepRuns(
        sweep_id=sweep_id, experiment_id=parent.info.experiment_id, parent_run_id=parent_id,
        parent_status=parent.info.status, parent_params=dict(parent.data.params), trials=trials,
        param_names=param_names, task_names=task_names,
        child_status_counts=dict(Counter(run.info.status for run in children)), notes=notes,
    )


def _trial_row(run) -> dict:
    row = {"run_id": run.info.run_id, "trial_number": int(run.data.tags[TRIAL_TAG]),
           "baseline": run.data.tags.get(BASELINE_TAG)}
    row.update({name: parse_param(text) for name, text in run.data.params.items()})
    row.update(run.data.metrics)
    row.update({f"tag.{key}": value for key, value in run.data.tags.items() if not key.startswith("mlflow.")})
    return row


def _with_derived_columns(trials: pd.DataFrame) -> pd.DataFrame:
    trials = trials.copy()
    for name, missing in (("press", "unknown"), ("merge", "unknown"), ("compression_ratio", np.nan)):
        trials[name] = trials[name].fillna(missing) if name in trials else missing
    trials["compression_ratio"] = trials["compression_ratio"].astype(float)
    # Rounded so that 1 - 0.9 reads 0.1 and budgets can be compared and used as keys.
    trials["budget"] = (1.0 - trials["compression_ratio"]).round(12)
    trials["method"] = [press if merge == "none" else f"{press}+{merge}"
                        for press, merge in zip(trials["press"], trials["merge"])]
    trials["configuration"] = [baseline if isinstance(baseline, str) else f"trial {number}"
                               for baseline, number in zip(trials["baseline"], trials["trial_number"])]
    return trials
