"""``grkv export``: one trial's press configuration, as a press file that ``grkv_core.press_from_file``
builds back into the press and ``grkv eval --press-config`` evaluates.

Read from MLflow alone, like the reports: the chosen run's params hold the press exactly as it ran
(``grkv_core.presses.from_config.resolved``), so the file carries every option of its merger, defaults included.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml
from mlflow.tracking import MlflowClient

from grkv_core.catalog import merger_option_specs
from grkv_core.config import QUESTION_AGNOSTIC, PressConfig
from grkv_core.option_specs import option_specs
from grkv_core.presses.from_config import PRESS_FILE_FIELDS, PROTOCOL_FIELD
from grkv_core.stream_options import DecodingOptions
from tracking.reports.data import BUDGET_SEPARATOR, SweepRuns, load_sweep, parse_param
from workers.names import EVICTION_ONLY, FULL_STAGE, PRESS_ARTIFACT, TEST_STAGE


@dataclass(frozen=True)
class Choice:
    """The run whose press is exported and why: ``how`` says in words which stage and ranking chose it."""

    run_id: str
    configuration: str
    how: str


@dataclass(frozen=True)
class Export:
    path: Path
    press: PressConfig
    text: str
    choice: Choice
    artifact_uri: str | None


def press_of_run(client: MlflowClient, run_id: str) -> PressConfig:
    """The press configuration a finished trial or test run ran, from its params (every field of its merger and, for
    a bounded cache, every ``DecodingOptions`` field)."""
    params = {name: parse_param(text) for name, text in client.get_run(run_id).data.params.items()}
    merge = params["merge"]
    return PressConfig(
        params["press"],
        params["compression_ratio"],
        merge,
        {name: params[name] for name in merger_option_specs(merge)},
        decoding={name: params[name] for name in option_specs(DecodingOptions) if name in params},
        per_head_cache=params.get("per_head_cache", False),
    )


def _ranked(frame: pd.DataFrame, metric: str, maximize: bool, tie_break: pd.Series | None = None) -> pd.DataFrame:
    """``frame``'s rows with ``metric``, best first; ties broken by ``tie_break`` (same direction), then in
    frame order."""
    if metric not in frame:
        return frame.iloc[:0]
    frame = frame[frame[metric].notna()]
    sign = -1.0 if maximize else 1.0
    keys = pd.DataFrame(
        {
            "value": sign * frame[metric].astype(float),
            "tie": sign * (tie_break.astype(float) if tie_break is not None else 0.0),
            "order": range(len(frame)),
        },
        index=frame.index,
    ).fillna(math.inf)
    return frame.loc[keys.sort_values(["value", "tie", "order"]).index]


def choose(runs: SweepRuns, trial: int | None = None) -> Choice:
    """The run to export: full-stage trial ``trial`` if given; else the best configuration of the test stage
    (held-out samples) if the sweep has one, else the main study's best trial, ranked by the first objective.

    NOTE: eviction-only at a larger budget (``eviction_only@0.7``) is a reference point of the test stage, not a
    candidate: the recommendation stays at the sweep's own budget. Test-stage ties go to the configuration with
    the better tuning score.
    """
    objective = runs.objectives[0]
    trials = runs.trials
    if trial is not None:
        rows = trials[trials["trial_number"] == trial]
        if rows.empty:
            finished = sorted(int(number) for number in trials["trial_number"])
            raise ValueError(f"sweep {runs.sweep_id!r} has no finished trial {trial} (finished: {finished})")
        row = rows.iloc[0]
        return Choice(row["run_id"], row["configuration"], f"trial {trial}, chosen with --trial")
    if runs.has_test_stage:
        tests = runs.test_trials[~runs.test_trials["test_of"].astype(str).str.contains(BUDGET_SEPARATOR)]
        tuning = trials.set_index("trial_number")[objective.metric] if objective.metric in trials else None
        tie = tests["trial_number"].map(tuning) if tuning is not None else None
        ranked = _ranked(tests, objective.metric, objective.maximize, tie)
        if not ranked.empty:
            row = ranked.iloc[0]
            how = (
                f"best of the test stage: {objective.metric} {row[objective.metric]:.4g} on "
                f"{runs.test_sample_count} held-out sample(s)"
            )
            is_eviction = tests["test_of"].astype(str) == EVICTION_ONLY
            if not is_eviction[row.name] and (tests.loc[is_eviction, objective.metric] == row[objective.metric]).any():
                how += "; eviction-only scores the same there: no merging configuration beat the base press"
            return Choice(row["run_id"], row["configuration"], how)
    ranked = _ranked(trials, objective.metric, objective.maximize)
    if ranked.empty:
        raise ValueError(f"sweep {runs.sweep_id!r} has no finished trial with {objective.metric} yet")
    row = ranked.iloc[0]
    return Choice(
        row["run_id"],
        row["configuration"],
        f"best trial of the main study: {objective.metric} {row[objective.metric]:.4g} on the tuning samples",
    )


def press_file_text(press: PressConfig, comments: list[str], protocol: str = QUESTION_AGNOSTIC) -> str:
    """A press file: ``comments`` as ``#`` lines, then the configuration (``PRESS_FILE_FIELDS``; ``decoding`` for a
    bounded cache only) and the protocol it was chosen under."""
    body = {name: getattr(press, name) for name in PRESS_FILE_FIELDS if name != PROTOCOL_FIELD}
    if not press.bounded:
        body.pop("decoding")
    body[PROTOCOL_FIELD] = protocol
    return "".join(f"# {line}\n" for line in comments) + yaml.safe_dump(body, sort_keys=False)


def export_press(
    client: MlflowClient,
    sweep_id: str,
    output: str | Path | None = None,
    *,
    trial: int | None = None,
    experiment: str | None = None,
    log_artifact: bool = True,
) -> Export:
    """Write the chosen run's press file (``choose``) to ``output`` (default ``./grkv-press-<sweep_id>.yaml``) and,
    with ``log_artifact``, to the sweep's parent run as ``press.yaml``.

    Raises
    ------
    tracking.reports.data.SweepNotFoundError
        No parent run carries ``sweep_id``.
    ValueError
        No such trial, or nothing finished yet.
    """
    runs = load_sweep(client, sweep_id, experiment, trial_predictions=False)
    choice = choose(runs, trial)
    press = press_of_run(client, choice.run_id)
    stage = TEST_STAGE if choice.run_id in set(runs.test_trials["run_id"]) else FULL_STAGE
    path = Path(output or f"grkv-press-{sweep_id}.yaml")
    text = press_file_text(
        press,
        [
            f"GRKV press configuration: {press.label}, exported by `grkv export` from sweep {sweep_id}",
            f"chosen: {choice.configuration} ({choice.how})",
            f"from: {stage}-stage run {choice.run_id} of parent run {runs.parent_run_id} "
            f"(experiment id {runs.experiment_id}, {client.tracking_uri})",
            f"exported: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
            f'use: press = grkv_core.presses.from_config.press_from_file("{path.name}"); with press(model): ...',
            f"or:  grkv eval --press-config {path.name}",
        ],
        runs.protocol,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    artifact_uri = None
    if log_artifact:
        client.log_text(runs.parent_run_id, text, PRESS_ARTIFACT)
        artifact_uri = f"{client.get_run(runs.parent_run_id).info.artifact_uri}/{PRESS_ARTIFACT}"
    return Export(path, press, text, choice, artifact_uri)
