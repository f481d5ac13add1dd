"""MLflow logging of a sweep: one parent run per sweep, one child run per trial (screening and full trials) and
per test-stage evaluation, found again by tags (``grkv.stage`` tells the stages apart)."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from grkv_core.config import (
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
from tracking.retry import RetryingClient, RetryPolicy, TrackingUnavailableError
from workers.protocol import TrialOutcome


def check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one clear sentence, when an HTTP tracking server does not answer /health."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            if response.status != 200:
                raise TrackingUnavailableError(f"MLflow tracking server {uri} answered HTTP {response.status} on /health")
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnavailableError(
            f"MLflow tracking server {uri} is not reachable ({reason}); start it (infra/local/start.sh) or fix tracking.tracking_uri"
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
    """MLflow params of the press as it ran (``PressConfig.resolved()``), under their own names."""
    return [Param(name, str(value)) for name, value in sorted(resolved_press.items())]


def trial_metrics(summary: dict) -> dict[str, float]:
    """The numbers of an evaluation summary, named for MLflow (per-task scores under ``score.<task>``)."""
    metrics = {"mean_score": summary["mean_score"]}  # None for screening trials, then left out
    metrics.update({f"score.{task}": value for task, value in summary["tasks"].items()})
    metrics.update({name: value for name, value in summary.get("costs", {}).items() if value is not None})
    return {name: float(value) for name, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


@dataclass
class SweepTracker:
    """Creates or finds the sweep's parent run and writes its trials' child runs."""

    client: MlflowClient
    experiment_id: str
    sweep_id: str
    parent_run_id: str

    @classmethod
    def open(cls, tracking_uri: str, experiment: str, sweep_id: str, config: dict,
             retry: RetryPolicy | None = None) -> "SweepTracker":
        """The sweep's tracker; with ``retry``, every MLflow call it (or its ``client``'s user) makes is retried."""
        client = MlflowClient(tracking_uri) if retry is None else RetryingClient(MlflowClient(tracking_uri), retry)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        parents = client.search_runs(
            [experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'", max_results=2
        )
        if parents:
            parent_id = parents[0].info.run_id
            client.update_run(parent_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=sweep_id, tags={SWEEP_TAG: sweep_id, ROLE_TAG: "sweep"})
            parent_id = run.info.run_id
            params = flatten("", config)
            client.log_batch(parent_id, params=[Param(key, value[:6000]) for key, value in params.items()])
            client.log_text(parent_id, json.dumps(config, indent=1), "sweep_config.json")
        return cls(client, experiment_id, sweep_id, parent_id)

    def child_runs(self, stage: str) -> dict[str, list]:
        """The child runs of ``stage``, by item (``TrialRequest.key``: trial number, or what a test run tests).

        NOTE: runs of sweeps from before stages carry no stage tag; they were full trials.
        """
        runs: dict[str, list] = {}
        for run in self.client.search_runs(
                [self.experiment_id], f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{ROLE_TAG}` = 'trial'",
                max_results=50000):
            if run.data.tags.get(STAGE_TAG, FULL_STAGE) == stage:
                key = run.data.tags[TEST_OF_TAG if stage == TEST_STAGE else TRIAL_TAG]
                runs.setdefault(key, []).append(run)
        return runs

    def start_trial(self, trial_number: int | None, params: dict, baseline: str | None = None, *,
                    stage: str = FULL_STAGE, test_of: str | None = None, tags: dict[str, str] | None = None) -> str:
        """Open a child run: a trial (its number) of the screening or full stage, or a test-stage evaluation
        (what it tests, ``test_of``), with further ``tags``; the sampler's raw parameters as ``optuna.<name>``
        params."""
        tags = {**(tags or {}), PARENT_TAG: self.parent_run_id, SWEEP_TAG: self.sweep_id, ROLE_TAG: "trial",
                STAGE_TAG: stage}
        if stage == TEST_STAGE:
            tags[TEST_OF_TAG] = test_of
            name = f"test-{test_of}"
        else:
            tags[TRIAL_TAG] = str(trial_number)
            name = f"{'trial' if stage == FULL_STAGE else stage}-{trial_number}"
        if baseline:
            tags[BASELINE_TAG] = baseline
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        self.client.log_batch(run.info.run_id, params=[Param(SAMPLER_PREFIX + k, str(v))
                                                       for k, v in sorted(params.items())])
        return run.info.run_id

    def finish_trial(self, run_id: str, outcome: TrialOutcome, timing: dict[str, float]) -> None:
        """Log a finished trial's press as it ran, its metrics, timings and predictions (when it generated any);
        close it as FINISHED."""
        now = int(time.time() * 1000)
        metrics = {**trial_metrics(outcome.summary), **timing}
        self.client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                              params=resolved_params(outcome.resolved_press),
                              tags=[RunTag(STATUS_TAG, "ok"), RunTag(WORKER_PID_TAG, str(outcome.worker.pid))])
        rows = [
            {"sample_id": row["sample_id"], "task": row["task"], "question": index, "prediction": prediction,
             "score": row["scores"][index]}
            for row in outcome.samples for index, prediction in enumerate(row["predictions"])
        ]
        if rows:
            self.client.log_text(run_id, json.dumps(rows, indent=1), "predictions.json")
        self.client.set_terminated(run_id, "FINISHED")

    def fail_trial(self, run_id: str, outcome: TrialOutcome, status: str = "FAILED") -> None:
        """Close a failed (or, with ``status="KILLED"``, abandoned) trial's run with its error."""
        self.client.log_batch(run_id, params=resolved_params(outcome.resolved_press),
                              tags=[RunTag(STATUS_TAG, "failed")])
        self.client.log_text(run_id, outcome.traceback or outcome.error, "error.txt")
        self.client.set_terminated(run_id, status)

    def update_parent(self, best: list[dict], completed: int, metrics: dict[str, float]) -> None:
        """Carry the best trials so far and ``metrics`` (progress, service overhead) on the parent run, at step
        ``completed`` (full trials completed)."""
        now = int(time.time() * 1000)
        logged = [Metric("completed_trials", completed, now, completed)]
        logged += [Metric(k, v, now, completed) for k, v in metrics.items()]
        if best:
            for index, value in enumerate(best[0]["values"]):
                logged.append(Metric(f"best_objective_{index}", value, now, completed))
        self.client.log_batch(self.parent_run_id, metrics=logged,
                              tags=[RunTag(BEST_TRIALS_TAG, json.dumps(best)[:4900])])

    def close(self, status: str, artifacts: dict[str, str] | None = None) -> None:
        """Log ``artifacts`` (file name -> text) on the parent run and close it with ``status``."""
        for name, text in (artifacts or {}).items():
            self.client.log_text(self.parent_run_id, text, name)
        self.client.set_terminated(self.parent_run_id, status)
