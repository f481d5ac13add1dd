"""A pool of Ray trial workers: dispatch batches to idle workers, wait for outcomes, retry on a restarted worker.

A worker that dies mid-batch is restarted by Ray (``max_restarts``) and reloads its model; its batch waits
until the worker answers a ping and is then sent again whole, at most ``max_retries`` times. A worker lost to
the cluster (its node or its owner died, an object was lost) is retried the same way but counted apart: those
batches are never failed, they come back marked ``infrastructure`` for the caller to re-queue. When the cluster
itself stops answering, ``wait`` raises ``ClusterLostError``. Otherwise every submitted request ends as exactly
one ``TrialOutcome`` from ``wait`` (or in one pending dispatch from ``drain``).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
)

from workers.protocol import TrialOutcome, TrialRequest
from workers.trial_worker import TrialWorker, WorkerStartError

RemoteTrialWorker = ray.remote(TrialWorker)

log = logging.getLogger("grkv.sweep")

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)
CLUSTER_FAILURES = (ObjectLostError, NodeDiedError, LocalRayletDiedError)
# NOTE: how Ray's ActorDiedError words a death that the actor's own work did not cause.
CLUSTER_DEATH_WORDS = ("node has died", "owner has died", "node died", "preempted")


class ClusterLostError(RuntimeError):
    """The Ray cluster stopped answering; the message is one line."""


def start_failure(error: Exception) -> WorkerStartError | None:
    """The one-line ``WorkerStartError`` of a worker whose creation failed (its ``__init__`` raised: a retry would
    fail the same way), or None for any other failure."""
    if not (isinstance(error, RayActorError) and error.actor_init_failed):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    ours = [line.split(f"{WorkerStartError.__name__}: ", 1)[1] for line in lines
            if f"{WorkerStartError.__name__}: " in line]
    return WorkerStartError(ours[-1] if ours else f"a worker could not start: {lines[-1] if lines else error}")


def lost_to_cluster(error: Exception) -> bool:
    """Whether a worker's failure is the cluster's doing (node, owner or object lost), not its trials'."""
    if isinstance(error, CLUSTER_FAILURES):
        return True
    return isinstance(error, ActorDiedError) and (
        error.preempted or any(words in str(error) for words in CLUSTER_DEATH_WORDS))


@dataclass
class Dispatch:
    """A batch on its way through the pool; ``context`` is the caller's, handed back with the outcomes."""

    requests: list[TrialRequest]
    context: Any
    worker: int
    attempt: int = 0
    submitted_at: float = 0.0
    # NOTE: re-sends after the cluster lost the worker; they never count against the trials (``attempt``).
    cluster_retries: int = 0
    infrastructure: bool = False

    def lost(self, error: str) -> list[TrialOutcome]:
        return [TrialOutcome.unfinished(request, error) for request in self.requests]


class WorkerPool:
    """``count`` workers, each loading ``eval_config`` (and ``test_samples`` more samples per task) once.

    Parameters
    ----------
    eval_config : dict
        ``EvalConfig.to_dict()`` of the sweep; each trial replaces its press.
    test_samples : int
        Samples per task each worker holds out for the test stage.
    count, num_cpus, num_gpus : int, float, float
        Workers and the Ray resources each holds.
    max_retries : int
        Re-sends of a batch whose worker died.
    """

    def __init__(self, eval_config: dict, test_samples: int, count: int, num_cpus: float, num_gpus: float,
                 max_retries: int):
        options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_retries * count, max_task_retries=0)
        self.workers = [RemoteTrialWorker.options(**options).remote(eval_config, test_samples) for _ in range(count)]
        # NOTE: read now, while the cluster answers: once its GCS is gone, every call into it blocks.
        self.gcs_address = ray.get_runtime_context().gcs_address
        self.max_retries = max_retries
        self.idle = list(range(count))
        self.running: dict[ray.ObjectRef, Dispatch] = {}
        # NOTE: a batch whose worker died waits here, keyed by a ping, until the restarted worker answers.
        self.pinging: dict[ray.ObjectRef, Dispatch] = {}

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def busy(self) -> int:
        """Trials in flight (not batches)."""
        return sum(len(dispatch.requests) for dispatch in [*self.running.values(), *self.pinging.values()])

    def submit(self, requests: list[TrialRequest], context: Any = None) -> None:
        """Send a batch of ``requests`` to an idle worker (the caller checks ``idle`` first)."""
        self._send(Dispatch(requests, context, self.idle.pop()))

    def wait(self, timeout_s: float = 1.0) -> list[tuple[Dispatch, list[TrialOutcome]]]:
        """The dispatches that ended within ``timeout_s`` (at least one, unless the time ran out), each with one
        outcome per request, in order."""
        ended = []
        ready, _ = ray.wait([*self.running, *self.pinging], num_returns=1, timeout=timeout_s)
        if not ready and (self.running or self.pinging):
            # NOTE: a call to an actor still starting waits on the GCS without ever failing; only a probe tells
            # that the cluster is gone.
            self._check_cluster()
        for reference in ready:
            if reference in self.pinging:
                self._after_ping(reference, ended)
                continue
            # NOTE: a dispatch leaves ``running`` only once the cluster is known to answer, so that a
            # ClusterLostError leaves it for ``drain``.
            dispatch = self.running[reference]
            try:
                outcomes = ray.get(reference)
                del self.running[reference]
            except (*WORKER_FAILURES, *CLUSTER_FAILURES) as error:
                self._check_cluster(error)
                if (failure := start_failure(error)) is not None:
                    raise failure from None  # NOTE: the dispatch stays in ``running``, for ``drain``
                del self.running[reference]
                cluster = lost_to_cluster(error)
                if (dispatch.cluster_retries if cluster else dispatch.attempt) < self.max_retries:
                    log.warning("%s: worker %s (%s); retrying", ", ".join(map(str, dispatch.requests)),
                                "lost to the cluster" if cluster else "died", type(error).__name__)
                    if cluster:
                        dispatch.cluster_retries += 1
                    else:
                        dispatch.attempt += 1
                    self._ping(dispatch)
                    continue
                dispatch.infrastructure = cluster
                outcomes = dispatch.lost(f"worker {'lost to the cluster' if cluster else 'died'} "
                                         f"{(dispatch.cluster_retries if cluster else dispatch.attempt) + 1} times: "
                                         f"{error}")
            self.idle.append(dispatch.worker)
            ended.append((dispatch, outcomes))
        return ended

    def drain(self) -> list[Dispatch]:
        """Give up every pending dispatch (on a stop) and return them."""
        pending = [*self.running.values(), *self.pinging.values()]
        self.running.clear()
        self.pinging.clear()
        return pending

    def _send(self, dispatch: Dispatch) -> None:
        dispatch.submitted_at = time.time()
        self.running[self.workers[dispatch.worker].evaluate_batch.remote(dispatch.requests)] = dispatch

    def _ping(self, dispatch: Dispatch) -> None:
        self.pinging[self.workers[dispatch.worker].identity.remote()] = dispatch

    def _after_ping(self, reference: ray.ObjectRef, ended: list) -> None:
        dispatch = self.pinging[reference]
        try:
            ray.get(reference)
            del self.pinging[reference]
        except ActorUnavailableError as error:  # still restarting (unless the cluster is gone): ask again shortly
            self._check_cluster(error)
            del self.pinging[reference]
            time.sleep(0.5)
            self._ping(dispatch)
            return
        except (*WORKER_FAILURES, *CLUSTER_FAILURES) as error:  # NOTE: a worker Ray gave up on is never idle again
            self._check_cluster(error)
            if (failure := start_failure(error)) is not None:
                raise failure from None
            del self.pinging[reference]
            dispatch.infrastructure = lost_to_cluster(error)
            ended.append((dispatch, dispatch.lost(f"worker is gone: {error}")))
            return
        self._send(dispatch)

    def _check_cluster(self, error: Exception | None = None, timeout_s: float = 3.0) -> None:
        """Raise ``ClusterLostError`` when the cluster's GCS no longer accepts connections.

        NOTE: probed with a plain TCP connection, never a Ray call: with the GCS gone, Ray calls block, and
        Ray ends the whole process after ``gcs_rpc_server_reconnect_timeout_s`` (60 s), so the driver has that
        long to record its in-flight trials and stop.
        """
        host, _, port = self.gcs_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as probe:
            seen = f"{type(error).__name__}; " if error is not None else ""
            raise ClusterLostError(f"the Ray cluster at {self.gcs_address} stopped answering "
                                   f"({seen}GCS: {probe.strerror or probe})") from None
