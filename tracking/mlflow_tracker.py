"""MLflow logging of a sweep: one parent run per sweep, one child run per trial (screening and full trials) and
per test-stage evaluation, found again by tags (``grkv.stage`` tells the stages apart).

What a person sees in the MLflow UI is set here too: the experiment opens on its runs (not MLflow 3's GenAI
overview), runs carry readable names, and ``runs_page_url`` opens a view with the objectives as columns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

from grkv_core.config import PressConfig
from grkv_core.evaluation.kvpress_layout import KVPRESS_FOLDER
from grkv_core.metrics import ANSWER_METRICS, LOSS_METRICS, STREAM_METRICS
from grkv_core.options import OPTION_SYMBOLS
from tracking.retry import RetryingClient, RetryPolicy, TrackingUnavailableError
from workers.names import (
    BASELINE_TAG,
    BEST_TRIALS_TAG,
    FULL_STAGE,
    PARENT_TAG,
    ROLE_TAG,
    SAMPLER_PREFIX,
    STAGE_TAG,
    STATUS_TAG,
    SWEEP_TAG,
    TEST_OF_TAG,
    TEST_STAGE,
    TRIAL_TAG,
    WORKER_PID_TAG,
)
from workers.protocol import TrialOutcome, WorkerIdentity

log = logging.getLogger("grkv.tracking")

# NOTE: MLflow prints two links for every run it closes, and they open MLflow 3's GenAI overview; the tracker
# logs the sweep's runs page once instead (``runs_page_url``).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

# NOTE: MLflow 3's UI opens an experiment as a GenAI app (a traces overview) unless told it is model training:
# releases before 3.17 read this experiment tag, 3.17 the sidebar's workflow switch, which a link sets with
# the ``workflowType`` URL parameter (``runs_page_url``). Both are set, so every MLflow 3 opens on the runs.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
WORKFLOW_TYPE_PARAM = "workflowType=machine_learning"
# The runs table of MLflow's "share view" links: the view is an experiment tag with this prefix, named in the
# URL by its key. Each sweep has one, keyed by the sweep id.
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RUN_NAME_COLUMN = "attributes.`Run Name`"
RUN_NAME_WIDTH_PX = 520
# What a predictions.json row carries of its sample besides the question's prediction and score: the answer
# metrics, where the needle sits (``answer_depth``, ``answer_in_window``), the reconstruction losses and a text's
# bounded-cache metrics.
SAMPLE_FIELDS = (*ANSWER_METRICS, "answer_in_window", "answer_depth", *LOSS_METRICS, *STREAM_METRICS)
# Per needle-depth bin of ``summarize``'s ``depth_scores``: the bin's score and its scored samples, as metrics.
DEPTH_SCORE_PREFIX = "score_depth."
DEPTH_SAMPLES_PREFIX = "samples_depth."


def check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one clear sentence, when an HTTP tracking server does not answer /health."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            if response.status != 200:
                raise TrackingUnavailableError(
                    f"MLflow tracking server {uri} answered HTTP {response.status} on /health"
                )
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnavailableError(
            f"MLflow tracking server {uri} is not reachable ({reason}); start it (infra/local/start.sh) or fix "
            "tracking.tracking_uri"
        ) from None


def flatten(prefix: str, value) -> dict[str, str]:
    """Nested dicts -> {"a.b": "value"} strings, as MLflow params want."""
    if isinstance(value, dict):
        flat = {}
        for key, inner in value.items():
            flat.update(flatten(f"{prefix}.{key}" if prefix else str(key), inner))
        return flat
    return {prefix: json.dumps(value) if isinstance(value, (list, tuple)) else str(value)}


def resolved_params(resolved_press: dict) -> list[Param]:
    """MLflow params of the press as it ran (``grkv_core.presses.from_config.resolved``), under their own names."""
    return [Param(name, str(value)) for name, value in sorted(resolved_press.items())]


def worker_params(worker: WorkerIdentity) -> list[Param]:
    """What the worker's model ran on: ``worker.device`` (``cuda:0``), ``worker.dtype`` (``dtype="auto"`` resolved)
    and, where Ray set it, ``worker.cuda_visible_devices``."""
    facts = {
        "worker.device": worker.device,
        "worker.dtype": worker.dtype,
        "worker.cuda_visible_devices": worker.visible_devices,
    }
    return [Param(name, str(value)) for name, value in facts.items() if value is not None]


def trial_metrics(summary: dict) -> dict[str, float]:
    """The numbers of an evaluation summary, named for MLflow: per-task scores under ``score.<task>``, the costs,
    losses and answer metrics, the score outside the press's always-kept window with the count of samples inside
    it (``window_samples``), and per needle-depth bin its score and samples (``score_depth.<bin>``,
    ``samples_depth.<bin>``)."""
    metrics = {
        "mean_score": summary["mean_score"],  # None for screening trials, then left out
        "mean_score_outside_window": summary.get("mean_score_outside_window"),
        "window_samples": summary.get("window_samples"),
    }
    metrics.update({f"score.{task}": value for task, value in summary["tasks"].items()})
    metrics.update({name: value for name, value in summary.get("costs", {}).items() if value is not None})
    for depth, scored in summary.get("depth_scores", {}).items():
        metrics.update({DEPTH_SCORE_PREFIX + depth: scored["score"], DEPTH_SAMPLES_PREFIX + depth: scored["samples"]})
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and math.isfinite(value)
    }


def prediction_rows(samples: list[dict]) -> list[dict]:
    """The rows of a run's ``predictions.json``: one per (sample, question) decoded, or one per sample (``question``,
    ``prediction`` and ``score`` None) where nothing was decoded (screening), each with its sample's
    ``SAMPLE_FIELDS``.

    Parameters
    ----------
    samples : list of dict
        ``SampleResult`` dicts (``TrialOutcome.samples``).

    NOTE: the answer metrics and losses are the sample's (means over its questions), repeated on each of its rows.
    """
    rows = []
    for sample in samples:
        shared = {
            "sample_id": sample["sample_id"],
            "task": sample["task"],
            **{name: sample.get(name) for name in SAMPLE_FIELDS},
        }
        decoded = [
            {"question": index, "prediction": prediction, "score": sample["scores"][index]}
            for index, prediction in enumerate(sample["predictions"])
        ]
        rows += [
            {**shared, **question} for question in decoded or [{"question": None, "prediction": None, "score": None}]
        ]
    return rows


def item_name(trial_number: int | None, stage: str, test_of: str | None, baseline: str | None) -> str:
    """What a child run is, first in its name: ``t12``, ``screen t3``, ``t0 baseline paper_default``,
    ``test t12`` (a test of trial 12), ``test eviction_only@0.5``."""
    if stage == TEST_STAGE:
        return f"test {'t' + test_of if test_of.isdigit() else test_of}"
    name = f"t{trial_number}" if stage == FULL_STAGE else f"{stage} t{trial_number}"
    return f"{name} baseline {baseline}" if baseline else name


def press_label(resolved_press: dict, searched: tuple[str, ...]) -> str:
    """The press as it ran, for a run's name: ``snapkv 25% + grkv λk=0.01 λv=0.1 β=0.1`` (the merger's searched
    options only, in the search space's order)."""
    label = PressConfig(
        resolved_press["press"],
        resolved_press["compression_ratio"],
        resolved_press["merge"],
        per_head_cache=resolved_press.get("per_head_cache", False),
    ).label
    values = [
        f"{OPTION_SYMBOLS.get(name, name)}={_short(resolved_press[name])}"
        for name in searched
        if name != "compression_ratio" and resolved_press["merge"] != "none" and name in resolved_press
    ]
    return " ".join([label, *values])


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.2g}".replace("e-0", "e-").replace("e+0", "e+")
    return str(value)


def objective_metrics(config: dict) -> list[str]:
    """The metrics the sweep optimises: the full stage's objectives, then the screening metric if it screens."""
    metrics = [objective["metric"] for objective in config["objectives"]]
    if config["screening"]["trials"]:
        metrics.append(config["screening"]["metric"])
    return list(dict.fromkeys(metrics))


def runs_view(sweep_id: str, config: dict) -> dict:
    """The runs table a sweep's link opens: its runs only, best first on the first objective, the objective
    metrics as columns and the run names wide enough to read.

    NOTE: sorted by a metric, MLflow lists child runs as rows of their own instead of folded under the parent
    (folding is per browser and cannot be preset); sorted by start time they fold again.
    """
    first = config["objectives"][0]
    return {
        "searchFilter": f"tags.`{SWEEP_TAG}` = '{sweep_id}'",
        "orderByKey": f"metrics.`{first['metric']}`",
        "orderByAsc": first["direction"] == "minimize",
        "selectedColumns": [f"metrics.`{metric}`" for metric in objective_metrics(config)],
        "columnOrder": [RUN_NAME_COLUMN],
        "columnWidths": {RUN_NAME_COLUMN: RUN_NAME_WIDTH_PX},
    }


def runs_page_url(tracking_uri: str, experiment_id: str, sweep_id: str) -> str:
    """The MLflow UI page of a sweep's runs (``runs_view``), as model training; for an HTTP tracking server."""
    query = f"{WORKFLOW_TYPE_PARAM}&viewStateShareKey={urllib.parse.quote(sweep_id)}"
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


@dataclass
class SweepTracker:
    """Creates or finds the sweep's parent run and writes its trials' child runs.

    ``searched`` names the search space's parameters, which the child runs' names show.
    """

    client: MlflowClient
    experiment_id: str
    sweep_id: str
    parent_run_id: str
    searched: tuple[str, ...]
    # NOTE: the names of the runs this tracker opened and has not closed yet, so that closing one costs no read, and
    # their sampler's parameters, logged with what closes them (one request a run fewer).
    names: dict[str, str] = field(default_factory=dict)
    sampler_params: dict[str, list[Param]] = field(default_factory=dict)
    # NOTE: and their artifact locations, where their files go straight (MLflow's client reads a run back for it
    # first, one request a file); with the tracking URI they need (none: through the client).
    artifact_uris: dict[str, str] = field(default_factory=dict)
    tracking_uri: str | None = None

    @classmethod
    def open(
        cls, tracking_uri: str, experiment: str, sweep_id: str, config: dict, retry: RetryPolicy | None = None
    ) -> "SweepTracker":
        """Find or create the experiment and the sweep's parent run (named ``sweep <id>``; the resolved
        configuration as its parameters), and store the sweep's runs view (``runs_page_url``); with ``retry``,
        every MLflow call it (or its ``client``'s user) makes is retried."""
        client = MlflowClient(tracking_uri) if retry is None else RetryingClient(MlflowClient(tracking_uri), retry)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        client.set_experiment_tag(
            experiment_id, SHARED_VIEW_TAG_PREFIX + sweep_id, json.dumps(runs_view(sweep_id, config))
        )
        parents = client.search_runs(
            [experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'", max_results=2
        )
        name = f"sweep {sweep_id}"
        if parents:
            parent_id = parents[0].info.run_id
            client.update_run(parent_id, status="RUNNING", name=name)
        else:
            run = client.create_run(experiment_id, run_name=name, tags={SWEEP_TAG: sweep_id, ROLE_TAG: "sweep"})
            parent_id = run.info.run_id
            params = flatten("", config)
            client.log_batch(parent_id, params=[Param(key, value[:6000]) for key, value in params.items()])
            client.log_text(parent_id, json.dumps(config, indent=1), "sweep_config.json")
        if tracking_uri.startswith(("http://", "https://")):
            log.info("MLflow: the sweep's runs at %s", runs_page_url(tracking_uri, experiment_id, sweep_id))
        return cls(client, experiment_id, sweep_id, parent_id, tuple(config["search_space"]), tracking_uri=tracking_uri)

    def child_runs(self, stage: str) -> dict[str, list]:
        """The child runs of ``stage``, by item (``TrialRequest.key``: trial number, or what a test run tests).

        NOTE: runs of sweeps from before stages carry no stage tag; they were full trials.
        """
        runs: dict[str, list] = {}
        for run in self.client.search_runs(
            [self.experiment_id],
            f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{ROLE_TAG}` = 'trial'",
            max_results=50000,
        ):
            if run.data.tags.get(STAGE_TAG, FULL_STAGE) == stage:
                key = run.data.tags[TEST_OF_TAG if stage == TEST_STAGE else TRIAL_TAG]
                runs.setdefault(key, []).append(run)
        return runs

    def start_trial(
        self,
        trial_number: int | None,
        params: dict,
        baseline: str | None = None,
        *,
        stage: str = FULL_STAGE,
        test_of: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> str:
        """Open a child run: a trial (its number) of the screening or full stage, or a test-stage evaluation
        (what it tests, ``test_of``), with further ``tags``; the sampler's raw parameters as ``optuna.<name>``
        params, logged when it closes (``finish_trial``, ``fail_trial``). Its name says what it is (``item_name``);
        the press is added once it ran."""
        tags = {
            **(tags or {}),
            PARENT_TAG: self.parent_run_id,
            SWEEP_TAG: self.sweep_id,
            ROLE_TAG: "trial",
            STAGE_TAG: stage,
        }
        if stage == TEST_STAGE:
            tags[TEST_OF_TAG] = test_of
        else:
            tags[TRIAL_TAG] = str(trial_number)
        if baseline:
            tags[BASELINE_TAG] = baseline
        name = item_name(trial_number, stage, test_of, baseline)
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        self.names[run.info.run_id] = name
        self.sampler_params[run.info.run_id] = [Param(SAMPLER_PREFIX + k, str(v)) for k, v in sorted(params.items())]
        self.artifact_uris[run.info.run_id] = run.info.artifact_uri
        return run.info.run_id

    def _upload(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """Log the file or folder ``path`` on ``run_id`` (under ``artifact_path``): straight to the run's artifact
        location when this tracker opened it, else through the client."""
        uri = self.artifact_uris.get(run_id)
        if uri is None or self.tracking_uri is None:
            log_files = self.client.log_artifacts if path.is_dir() else self.client.log_artifact
            log_files(run_id, str(path), artifact_path)
            return
        repository = get_artifact_repository(uri, tracking_uri=self.tracking_uri)
        log_files = repository.log_artifacts if path.is_dir() else repository.log_artifact
        if isinstance(self.client, RetryingClient):
            self.client.retried(log_files, str(path), artifact_path, what="log_artifact")
        else:
            log_files(str(path), artifact_path)

    def _log_text(self, run_id: str, text: str, name: str) -> None:
        """Log ``text`` as the file ``name`` on ``run_id`` (``_upload``)."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / name
            path.write_text(text)
            self._upload(run_id, path)

    def _named_with_press(self, run_id: str, resolved_press: dict) -> list[RunTag]:
        """The tag that renames a run to its name at start followed by the press it ran (none if unknown)."""
        name = self.names.pop(run_id, None)
        if not resolved_press:
            return []
        name = name or self.client.get_run(run_id).info.run_name
        return [RunTag(MLFLOW_RUN_NAME, f"{name} {press_label(resolved_press, self.searched)}")]

    def finish_trial(
        self, run_id: str, outcome: TrialOutcome, timing: dict[str, float], kvpress_folder: Path | None = None
    ) -> None:
        """Log a finished trial's press as it ran (also in its name), what its worker ran it on (``worker_params``),
        its metrics, timings and per-sample rows (``prediction_rows``, screening runs included), and
        ``kvpress_folder`` (a test-stage run's results in kvpress's layout, as the state directory holds them) as
        its artifacts ``kvpress/``; close it as FINISHED."""
        now = int(time.time() * 1000)
        metrics = {**trial_metrics(outcome.summary), **timing}
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
            params=[
                *self.sampler_params.pop(run_id, []),
                *resolved_params(outcome.resolved_press),
                *worker_params(outcome.worker),
            ],
            tags=[
                RunTag(STATUS_TAG, "ok"),
                RunTag(WORKER_PID_TAG, str(outcome.worker.pid)),
                *self._named_with_press(run_id, outcome.resolved_press),
            ],
        )
        rows = prediction_rows(outcome.samples)
        if rows:
            self._log_text(run_id, json.dumps(rows, indent=1), "predictions.json")
        if kvpress_folder is not None:
            self._upload(run_id, kvpress_folder, KVPRESS_FOLDER)
        self.client.set_terminated(run_id, "FINISHED")
        self.artifact_uris.pop(run_id, None)

    def fail_trial(self, run_id: str, outcome: TrialOutcome, status: str = "FAILED") -> None:
        """Close a failed (or, with ``status="KILLED"``, abandoned) trial's run with its error."""
        self.client.log_batch(
            run_id,
            params=[*self.sampler_params.pop(run_id, []), *resolved_params(outcome.resolved_press)],
            tags=[RunTag(STATUS_TAG, "failed"), *self._named_with_press(run_id, outcome.resolved_press)],
        )
        self._log_text(run_id, outcome.traceback or outcome.error, "error.txt")
        self.client.set_terminated(run_id, status)
        self.artifact_uris.pop(run_id, None)

    def update_parent(self, best: list[dict], completed: int, metrics: dict[str, float]) -> None:
        """Carry the best trials so far and ``metrics`` (progress, service overhead) on the parent run, at step
        ``completed`` (full trials completed)."""
        now = int(time.time() * 1000)
        logged = [Metric("completed_trials", completed, now, completed)]
        logged += [Metric(k, v, now, completed) for k, v in metrics.items()]
        if best:
            for index, value in enumerate(best[0]["values"]):
                logged.append(Metric(f"best_objective_{index}", value, now, completed))
        self.client.log_batch(
            self.parent_run_id, metrics=logged, tags=[RunTag(BEST_TRIALS_TAG, json.dumps(best)[:4900])]
        )

    def close(self, status: str, artifacts: dict[str, str] | None = None) -> None:
        """Log ``artifacts`` (file name -> text) on the parent run and close it with ``status``."""
        for name, text in (artifacts or {}).items():
            self.client.log_text(self.parent_run_id, text, name)
        self.client.set_terminated(self.parent_run_id, status)
