"""The Ray actor that holds one loaded model and its evaluation samples, and evaluates many trials in batches.

NOTE: the class imports no Ray: outside a Ray cluster (in-process, ``benchmarks/gpu_check.py`` on a machine without
Ray) it runs as it is; the sweep's driver makes it an actor (``sweeps.worker_pool``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

from grkv_core.config import EvalConfig
from grkv_core.evaluation.kvpress_layout import kvpress_runs
from grkv_core.evaluation.results import ResultStore, summarize
from grkv_core.evaluation.run import EvaluationSetup, evaluate_samples
from grkv_core.files import storage_failure
from grkv_core.presses.from_config import BuiltPress, resolved
from workers.names import FULL_STAGE, SCREEN_STAGE, TEST_STAGE
from workers.protocol import FAILED, OK, TrialOutcome, TrialRequest, WorkerIdentity

log = logging.getLogger("grkv.sweep")

# A folder on a node where its workers keep their trials' per-sample checkpoints instead of the state directory's
# ``checkpoints/`` (the path each request names is kept below it: ``<folder>/<that path>``), set in the environment
# of that node's ``ray start``, whose workers inherit it. For a node whose disk at the state directory's path is slow
# (a network volume) or not the user's; its checkpoints are read by the workers of that node only, and a finished
# trial's checkpoint stays there (the driver removes those in the state directory only).
CHECKPOINT_DIR_ENV = "GRKV_CHECKPOINT_DIR"


class WorkerStartError(RuntimeError):
    """A worker cannot start on its node (the sweep's model or device does not fit it); the message is one line
    naming the node. Raised in the actor's creation, where a retry would fail the same way."""


class WorkerStorageError(RuntimeError):
    """A worker cannot write its trials' checkpoints (a full or read-only disk on its node): no trial's fault, and
    any trial it is given would fail the same way; the message is one line naming the node."""


def _ray_context():
    """Ray's runtime context inside a Ray worker, else None.

    NOTE: asked outside Ray, the runtime context would start a local Ray instance; in-process there is no node or
    actor to name (and Ray need not be installed).
    """
    ray = sys.modules.get("ray")
    return ray.get_runtime_context() if ray is not None and ray.is_initialized() else None


def _node_name() -> str:
    """This node as a person finds it: its host name and, inside Ray, its node id."""
    context = _ray_context()
    return socket.gethostname() + (f" (Ray node {context.get_node_id()[:12]})" if context else "")


def check_device(device: str) -> None:
    """Raise ``WorkerStartError`` where a worker is to run its model on CUDA and its node has none."""
    if device == "cuda" and not torch.cuda.is_available():
        raise WorkerStartError(
            f"a worker cannot start on node {_node_name()}: model.device is 'cuda' and torch "
            "sees no CUDA device there (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run the workers on GPU nodes "
            "(workers.num_gpus: 1) or set model.device: auto or cpu"
        )


def split_samples(samples: list, tuning_per_task: int) -> dict[str, list]:
    """The samples each stage evaluates: the first ``tuning_per_task`` of each task tune (screening and full
    trials), the rest are the held-out test samples (``EvalSample``s, or anything with ``task`` and ``sample_id``).

    Raises
    ------
    ValueError
        If a sample id is both a tuning and a test sample.
    """
    seen: Counter[str] = Counter()
    tuning, test = [], []
    for sample in samples:
        (tuning if seen[sample.task] < tuning_per_task else test).append(sample)
        seen[sample.task] += 1
    # NOTE: disjoint by construction (one load, split by position); checked because every test-stage
    # comparison rests on it.
    overlap = {sample.sample_id for sample in tuning} & {sample.sample_id for sample in test}
    if overlap:
        raise ValueError(f"tuning and test samples share ids {sorted(overlap)}")
    return {SCREEN_STAGE: tuning, FULL_STAGE: tuning, TEST_STAGE: test}


class TrialWorker:
    """Loads the model and the samples once in ``__init__``; ``evaluate_batch`` runs trials' presses on them.

    Run as a Ray actor (``sweeps.worker_pool``); the class itself also works in-process.

    Parameters
    ----------
    eval_config : dict
        ``EvalConfig.to_dict()`` of the sweep (model, data, dtype...); its ``samples`` (per task) tune, and its
        press is replaced per trial.
    test_samples : int
        Further samples per task held out for the test stage, loaded in the same call as the tuning ones.
    """

    def __init__(self, eval_config: dict, test_samples: int = 0):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a worker's log is no terminal
        config = EvalConfig.from_dict(eval_config)
        self.config = replace(config, samples=config.samples + test_samples)
        check_device(self.config.device)
        self.setup = EvaluationSetup.load(self.config)
        self.samples = split_samples(self.setup.samples, config.samples)
        self.loaded, self.model_dtype, self.sample_total = (
            self.setup.loaded,
            self.setup.model_dtype,
            len(self.setup.samples),
        )
        self.model_loads = 1
        self.trials_evaluated = 0

    def identity(self) -> WorkerIdentity:
        context = _ray_context()
        return WorkerIdentity(
            pid=os.getpid(),
            node_id=context.get_node_id() if context else "local",
            actor_id=(context.get_actor_id() if context else None) or "local",
            model_loads=self.model_loads,
            trials_evaluated=self.trials_evaluated,
            samples=self.sample_total,
            device=str(self.loaded.model.device),
            dtype=self.model_dtype,
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    def evaluate_batch(self, requests: list[TrialRequest]) -> list[TrialOutcome]:
        """Evaluate trials of one stage together; one outcome per request, in order.

        Sample-major: each sample is evaluated for every trial at once (``Evaluator.evaluate_trials``, one
        prefill per sample). Screening trials generate nothing; test-stage trials run on the test samples.
        Errors (CUDA OOM included) come back as failed outcomes, never raised: a batch that fails is evaluated
        again one trial at a time, so only the trials that fail on their own are failed.

        Raises
        ------
        WorkerStorageError
            A checkpoint cannot be written (the node's disk is full or read-only).
        """
        stages = {request.stage for request in requests}
        if len(stages) != 1:
            raise ValueError(f"a batch holds trials of one stage, got {sorted(stages)}")
        if len(requests) > 1:
            try:
                return self._evaluate(requests)
            except Exception as error:  # noqa: BLE001 - a batch's failure must not take the worker down
                self._raise_if_storage(error)
                self._release(error)
                log.warning(
                    "a batch of %d trials failed (%s: %s); evaluating them one at a time",
                    len(requests),
                    type(error).__name__,
                    error,
                )
        return [self._evaluate_alone(request) for request in requests]

    def _evaluate_alone(self, request: TrialRequest) -> TrialOutcome:
        started = time.time()
        try:
            return self._evaluate([request])[0]
        except Exception as error:  # noqa: BLE001 - a trial's failure must not take the worker down
            self._raise_if_storage(error)
            self._release(error)
            if isinstance(error, torch.cuda.OutOfMemoryError):
                details = dict(error=f"CUDA out of memory: {error}")
            else:
                details = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
            return TrialOutcome.of(
                request,
                FAILED,
                started_at=started,
                finished_at=time.time(),
                worker=self.identity(),
                resolved_press=resolved(request.press),
                **details,
            )

    def _evaluate(self, requests: list[TrialRequest]) -> list[TrialOutcome]:
        started = time.time()
        stage = requests[0].stage
        # NOTE: each trial's press is built here, once, for every sample it runs on.
        presses = [BuiltPress.of(request.press) for request in requests]
        checkpoints = [self._checkpoint(request, press) for request, press in zip(requests, presses)]
        ids = {sample.sample_id for sample in self.samples[stage]}
        resumed = [sum(row.sample_id in ids for row in store.results) if store else 0 for store in checkpoints]
        per_trial = evaluate_samples(
            self.setup.evaluator,
            self.samples[stage],
            presses,
            checkpoints,
            decode=self._stage_config(requests[0]).decode,
        )
        evaluated = [
            dict(
                summary=summarize(results),
                samples=[asdict(result) for result in results],
                kvpress_runs=self._kvpress_runs(request, press, results),
            )
            for request, press, results in zip(requests, presses, per_trial)
        ]
        return self._finished(requests, started, presses, evaluated, resumed)

    def _finished(
        self, requests: list[TrialRequest], started: float, presses: list[BuiltPress], evaluated: list, resumed: list
    ) -> list[TrialOutcome]:
        """The outcomes of a batch evaluated since ``started``: per request its built press, what it evaluated
        (``TrialOutcome`` fields: ``summary``, ``samples``...) and how many samples it resumed."""
        finished = time.time()
        self.trials_evaluated += len(requests)
        identity = self.identity()
        return [
            TrialOutcome.of(
                request,
                OK,
                started_at=started,
                finished_at=finished,
                batch_trials=len(requests),
                worker=identity,
                resolved_press=press.settings,
                resumed_samples=count,
                **fields,
            )
            for request, press, fields, count in zip(requests, presses, evaluated, resumed)
        ]

    def _kvpress_runs(self, request: TrialRequest, press: BuiltPress, results: list) -> list[dict]:
        """A test-stage evaluation's results in kvpress's layout (the test samples' texts are the worker's)."""
        if request.stage != TEST_STAGE:
            return []
        return [
            run.to_dict()
            for run in kvpress_runs(
                self._stage_config(request),
                self.samples[TEST_STAGE],
                results,
                str(press.press),
                {"summary": summarize(results)},
            )
        ]

    def _checkpoint(self, request: TrialRequest, press: BuiltPress) -> ResultStore | None:
        """The store of a request's per-sample results (``TrialRequest.checkpoint``, below this node's
        ``CHECKPOINT_DIR_ENV`` where set), or None."""
        path = self._checkpoint_path(request)
        if path is None:
            return None
        return ResultStore(path, self._stage_config(request), self.model_dtype, press.settings)

    @staticmethod
    def _checkpoint_path(request: TrialRequest) -> Path | None:
        """``TrialRequest.checkpoint`` below this node's ``CHECKPOINT_DIR_ENV`` where set, its folder made; or None."""
        path = request.checkpoint
        if path is None:
            return None
        if os.environ.get(CHECKPOINT_DIR_ENV):
            path = Path(os.environ[CHECKPOINT_DIR_ENV]) / path.relative_to(path.anchor)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _stage_config(self, request: TrialRequest) -> EvalConfig:
        """The evaluation a request's stage runs: its press; screening generates nothing."""
        return replace(self.config, press=request.press, decode=request.stage != SCREEN_STAGE)

    @staticmethod
    def _raise_if_storage(error: Exception) -> None:
        """A checkpoint that cannot be written fails the worker's whole batch as ``WorkerStorageError``, never its
        trials: the same trials succeed on a node with room."""
        if storage_failure(error):
            where = f": {error.filename}" if error.filename else ""
            raise WorkerStorageError(
                f"a worker on node {_node_name()} cannot write its checkpoints "
                f"({error.strerror or error}{where}); free space there"
            ) from None

    @staticmethod
    def _release(error: Exception) -> None:
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
