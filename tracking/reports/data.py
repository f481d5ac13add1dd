"""A sweep read back from MLflow alone: its parent run, and one row per finished run of each stage.

Everything here comes from the tags, params, metrics and ``predictions.json`` artifacts that
:mod:`tracking.mlflow_tracker` writes, so a sweep can be reported while it runs, after it finished, or long
after its Optuna storage is gone.

A sweep has up to three stages (tag ``grkv.stage``): screening (losses and answer metrics, no score), full
scoring on the tuning samples, and the held-out test stage. Runs without the tag are full-stage runs (sweeps
logged before stages existed).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from grkv_core.config import QUESTION_AGNOSTIC
from tracking.reports.predictions import PREDICTION_COLUMNS, load_predictions
from workers.names import (
    BASELINE_TAG,
    FULL_STAGE,
    PARENT_TAG,
    ROLE_TAG,
    SAMPLER_PREFIX,
    SCREEN_STAGE,
    STAGE_TAG,
    STAGES,
    SWEEP_TAG,
    TEST_OF_TAG,
    TEST_STAGE,
    TRIAL_TAG,
)

# NOTE: a report downloads one small predictions.json per full- and test-stage run (never the screening runs', which
# can be many); MLflow would draw a progress bar for each.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

SCORE_PREFIX = "score."
# A test-stage run of a baseline at another budget than the sweep's names it "eviction_only@0.88".
BUDGET_SEPARATOR = "@"
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
    """The finished runs of one sweep, as logged in MLflow, one frame per stage.

    Attributes
    ----------
    sweep_id, experiment_id, parent_run_id, parent_status : str
        Identity of the sweep's parent run and its current MLflow status (RUNNING while the sweep runs).
    parent_params : dict[str, str]
        The flattened sweep config (``press.name``, ``search_space.beta.low``, ``objectives``...).
    trials : pandas.DataFrame
        The full-stage runs (scored on the tuning samples), which every analysis uses unless it says
        otherwise: one row per FINISHED run, ordered by trial number: ``run_id``, ``stage``, ``trial_number``,
        ``baseline`` (``paper_default``/``eviction_only`` or None), the press as it ran
        (``grkv_core.presses.from_config.resolved``: ``press``, ``compression_ratio``, ``merge``, every merger option
        such as ``lambda_k``, ``press.window_size``...; typed, NaN where a trial's press has no such field), the
        sampler's raw proposals as ``optuna.<name>``, every metric, every non-``mlflow.`` tag as ``tag.<key>``
        (``tag.grkv.status``...), and derived ``budget`` (= 1 - compression ratio), ``method`` (press, or
        press+merger) and ``configuration`` (baseline name or ``trial N``).
    screen_trials : pandas.DataFrame
        The screening-stage runs (losses, no score), same columns; their trial numbers are those of the
        screening study, so they are distinct from the full-stage ones.
    test_trials : pandas.DataFrame
        The held-out test-stage runs, one per confirmed configuration, same columns plus ``test_of`` (the
        ``grkv.test_of`` tag: a full-stage trial number or a baseline label such as ``eviction_only@0.88``);
        ``trial_number`` is the full-stage trial it confirms (NaN for a baseline with no full-stage run at
        that budget) and ``configuration`` that trial's, or the baseline label.
    test_predictions : pandas.DataFrame
        The test-stage runs' per-question rows from their ``predictions.json`` (``PREDICTION_COLUMNS``):
        ``run_id``, ``sample_id``, ``task``, ``question``, ``score`` (0-1), and the sample's ``answer_nll``,
        ``answer_kl``, ``answer_top1``, ``answer_in_window`` (nullable boolean), ``answer_depth``, ``window_loss``,
        ``heldout_loss``, ``question_loss`` (NaN where a run logged them not, e.g. before they existed).
    trial_predictions : pandas.DataFrame
        The same rows of the full-stage runs (tuning samples): what within-sample correlations pair.
    param_names : list[str]
        The sampler's parameters of the full-stage study, as Optuna named them (their values are the
        ``optuna.<name>`` columns).
    task_names : list[str]
        Tasks with a ``score.<task>`` metric on a full- or test-stage run.
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
    screen_trials: pd.DataFrame = field(default_factory=lambda: _empty_stage(SCREEN_STAGE))
    test_trials: pd.DataFrame = field(default_factory=lambda: _empty_stage(TEST_STAGE))
    test_predictions: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PREDICTION_COLUMNS))
    trial_predictions: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PREDICTION_COLUMNS))
    notes: list[str] = field(default_factory=list)

    @property
    def has_test_stage(self) -> bool:
        return not self.test_trials.empty

    @property
    def test_sample_count(self) -> int:
        """Distinct held-out samples (task, sample id) in the test-stage runs' predictions."""
        return len(self.test_predictions[["task", "sample_id"]].drop_duplicates())

    @property
    def stage_counts(self) -> dict[str, int]:
        """Finished runs per stage (screen, full, test)."""
        return {SCREEN_STAGE: len(self.screen_trials), FULL_STAGE: len(self.trials), TEST_STAGE: len(self.test_trials)}

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
    def protocol(self) -> str:
        """The sweep's evaluation protocol (sweeps started before protocols existed were question-agnostic)."""
        return self.parent_params.get("data.protocol", QUESTION_AGNOSTIC)

    @property
    def data_seed(self) -> str:
        return self.parent_params.get("data.seed", "0")

    def baseline_trial(self, name: str) -> pd.Series | None:
        """The trial enqueued as baseline ``name``, or None."""
        rows = self.trials[self.trials["baseline"] == name]
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
        page = client.search_runs(
            experiment_ids, filter_string, run_view_type=ViewType.ACTIVE_ONLY, max_results=_PAGE, page_token=token
        )
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
    parents = search_all_runs(
        client, experiment_ids, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'"
    )
    if not parents:
        raise SweepNotFoundError(
            f"sweep {sweep_id!r} not found in {where} (no run tagged {SWEEP_TAG}={sweep_id}, {ROLE_TAG}=sweep)"
        )
    if len({run.info.experiment_id for run in parents}) > 1:
        raise SweepNotFoundError(f"sweep {sweep_id!r} exists in several experiments; name one with --experiment")
    return parents[0]


def load_sweep(
    client: MlflowClient, sweep_id: str, experiment: str | None = None, *, trial_predictions: bool = True
) -> SweepRuns:
    """Read a sweep, finished or running, from MLflow into a :class:`SweepRuns`.

    Parameters
    ----------
    client : mlflow.tracking.MlflowClient
        A client of the tracking store the sweep logged to.
    sweep_id : str
        The sweep's id (the ``grkv.sweep_id`` tag).
    experiment : str, optional
        Look only in this experiment (default: every active experiment).
    trial_predictions : bool
        Download every full-stage trial's ``predictions.json`` (one request a trial: minutes for thousands of
        trials); False leaves ``SweepRuns.trial_predictions`` empty, for readers that need only the runs' metrics and
        the test stage (``grkv export``).
    """
    parent = find_parent_run(client, sweep_id, experiment)
    parent_id = parent.info.run_id
    children = [
        run
        for run in search_all_runs(
            client, [parent.info.experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'trial'"
        )
        if run.data.tags.get(PARENT_TAG) == parent_id
    ]
    notes: list[str] = []
    by_stage: dict[str, list] = {stage: [] for stage in STAGES}
    for run in children:
        stage = run.data.tags.get(STAGE_TAG, FULL_STAGE)
        if stage not in by_stage:
            notes.append(f"run {run.info.run_id} has unknown stage {stage!r}; left out")
        elif run.info.status == "FINISHED":
            by_stage[stage].append(run)
    full_runs = _latest_per_key(by_stage[FULL_STAGE], TRIAL_TAG, "trial", notes)
    trials = _stage_frame(full_runs, FULL_STAGE)
    screen_trials = _stage_frame(
        _latest_per_key(by_stage[SCREEN_STAGE], TRIAL_TAG, "screening trial", notes), SCREEN_STAGE
    )
    test_trials = _confirming(
        _stage_frame(_latest_per_key(by_stage[TEST_STAGE], TEST_OF_TAG, "test of", notes), TEST_STAGE), trials
    )
    param_names = sorted(
        {
            name.removeprefix(SAMPLER_PREFIX)
            for run in full_runs
            for name in run.data.params
            if name.startswith(SAMPLER_PREFIX)
        }
    )
    task_names = sorted(
        {
            column.removeprefix(SCORE_PREFIX)
            for frame in (trials, test_trials)
            for column in frame.columns
            if column.startswith(SCORE_PREFIX)
        }
    )
    return SweepRuns(
        sweep_id=sweep_id,
        experiment_id=parent.info.experiment_id,
        parent_run_id=parent_id,
        parent_status=parent.info.status,
        parent_params=dict(parent.data.params),
        trials=trials,
        param_names=param_names,
        task_names=task_names,
        child_status_counts=dict(Counter(run.info.status for run in children)),
        screen_trials=screen_trials,
        test_trials=test_trials,
        test_predictions=load_predictions(client, _artifact_uris(children, test_trials), notes, "test-stage"),
        trial_predictions=load_predictions(client, _artifact_uris(children, trials), notes, "full-stage")
        if trial_predictions
        else pd.DataFrame(columns=PREDICTION_COLUMNS),
        notes=notes,
    )


def _artifact_uris(runs: list, frame: pd.DataFrame) -> dict[str, str]:
    """The artifact URI of each run of ``frame``, in its order."""
    uris = {run.info.run_id: run.info.artifact_uri for run in runs}
    return {run_id: uris[run_id] for run_id in frame["run_id"]}


def _latest_per_key(runs: list, tag: str, what: str, notes: list[str]) -> list:
    """One run per value of ``tag`` (the latest to end where several finished), in natural key order.

    NOTE: the key is (stage, tag value): screening trials are numbered in their own study, so a screening
    trial and a full-stage trial may share a number; callers pass one stage's runs at a time.
    """
    by_key: dict[str, object] = {}
    for run in runs:
        key = run.data.tags.get(tag)
        if key is None:
            notes.append(f"run {run.info.run_id} lacks the {tag} tag; left out")
            continue
        if key in by_key:
            notes.append(f"{what} {key} has several FINISHED runs; the latest is used")
        if key not in by_key or run.info.end_time > by_key[key].info.end_time:
            by_key[key] = run
    return [by_key[key] for key in sorted(by_key, key=_natural_key)]


def _natural_key(key: str) -> tuple:
    return (0, int(key), "") if _INTEGER.fullmatch(key) else (1, 0, key)


def _stage_frame(runs: list, stage: str) -> pd.DataFrame:
    """The runs of one stage as rows; a test stage's ``configuration`` is left to :func:`_confirming`."""
    rows = [_trial_row(run, stage) for run in runs]
    frame = _with_derived_columns(pd.DataFrame(rows) if rows else _empty_stage(stage))
    if stage != TEST_STAGE:
        frame["configuration"] = [
            baseline if isinstance(baseline, str) else f"trial {number}"
            for baseline, number in zip(frame["baseline"], frame["trial_number"])
        ]
    return frame


def _empty_stage(stage: str) -> pd.DataFrame:
    columns = ["run_id", "stage", "trial_number", "baseline", "merge"] + (["test_of"] if stage == TEST_STAGE else [])
    return pd.DataFrame(columns=columns)


def _confirming(test_trials: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """Test-stage runs with the full-stage trial each confirms: its number, baseline and configuration.

    A numeric ``test_of`` names the trial; a baseline label (``paper_default``, ``eviction_only@0.88``)
    names the full-stage baseline run at the test run's own compression ratio, when the sweep has one.
    """
    test_trials = test_trials.copy()
    numbers, baselines, configurations = [], [], []
    for _, run in test_trials.iterrows():
        label = str(run["test_of"])
        if _INTEGER.fullmatch(label):
            confirmed = trials[trials["trial_number"] == int(label)]
            baseline = confirmed["baseline"].iloc[0] if len(confirmed) else None
            configuration = confirmed["configuration"].iloc[0] if len(confirmed) else f"trial {label}"
            number = int(label)
        else:
            baseline, configuration = label.partition(BUDGET_SEPARATOR)[0], label
            confirmed = trials[(trials["baseline"] == baseline) & np.isclose(trials["budget"], run["budget"])]
            number = confirmed["trial_number"].iloc[0] if len(confirmed) else np.nan
        numbers.append(number)
        baselines.append(baseline)
        configurations.append(configuration)
    test_trials["trial_number"] = pd.Series(numbers, index=test_trials.index, dtype=float)
    test_trials["baseline"] = pd.Series(baselines, index=test_trials.index, dtype=object)
    test_trials["configuration"] = pd.Series(configurations, index=test_trials.index, dtype=object)
    return test_trials


def _trial_row(run, stage: str) -> dict:
    tags = run.data.tags
    row = {"run_id": run.info.run_id, "stage": stage, "baseline": tags.get(BASELINE_TAG)}
    if stage == TEST_STAGE:
        row["test_of"] = tags[TEST_OF_TAG]  # NOTE: the trial number it confirms is resolved by _confirming
    else:
        row["trial_number"] = int(tags[TRIAL_TAG])
    row.update({name: parse_param(text) for name, text in run.data.params.items()})
    row.update(run.data.metrics)
    row.update({f"tag.{key}": value for key, value in tags.items() if not key.startswith("mlflow.")})
    return row


def _with_derived_columns(trials: pd.DataFrame) -> pd.DataFrame:
    trials = trials.copy()
    for name, missing in (("press", "unknown"), ("merge", "unknown"), ("compression_ratio", np.nan)):
        trials[name] = trials[name].fillna(missing) if name in trials else missing
    trials["compression_ratio"] = trials["compression_ratio"].astype(float)
    # Rounded so that 1 - 0.9 reads 0.1 and budgets can be compared and used as keys.
    trials["budget"] = (1.0 - trials["compression_ratio"]).round(12)
    if "target_size" in trials:
        # NOTE: a bounded cache's budget is its size in tokens (``budget_text``), never a fraction: always above 1.
        trials["budget"] = trials["target_size"].astype(float).fillna(trials["budget"])
    trials["method"] = [
        press if merge == "none" else f"{press}+{merge}" for press, merge in zip(trials["press"], trials["merge"])
    ]
    return trials
