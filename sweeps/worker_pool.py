"""A pool of Ray trial workers: dispatch batches to idle workers, wait for outcomes, retry on a restarted worker.

A worker that fails mid-batch is restarted by Ray (at most ``max_retries`` times) and reloads its model; its batch
waits until the worker answers a ping and is then sent again whole (each trial resumes at its next sample, from
its checkpoint). Whose fault the failure was is decided then, by the node the worker ran on: a node the cluster
has lost (or a Ray error that says so) is the cluster's doing and counted apart (``cluster_retries``) from the
worker's own deaths (``attempt``). A worker Ray gave up on is re-created when its node was lost, and retired
otherwise, its batch handed back marked ``infrastructure`` for the caller to re-queue: no trial is ever failed
for its worker's death. With no worker left, or no node able to hold one for ``node_wait_s``, ``wait`` raises
``NoWorkerLeftError``; when the cluster itself stops answering, ``ClusterLostError``; when a worker cannot write
its checkpoints, ``WorkerStorageError``. Otherwise every submitted request ends as exactly one ``TrialOutcome``
from ``wait`` (or in one pending dispatch from ``drain``).
"""

from __future__ import annotations

import logging
import os
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
from workers.trial_worker import TrialWorker, WorkerStartError, WorkerStorageError

log = logging.getLogger("grkv.sweep")

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)
CLUSTER_FAILURES = (ObjectLostError, NodeDiedError, LocalRayletDiedError)
# NOTE: how Ray's ActorDiedError words a death that the actor's own work did not cause.
CLUSTER_DEATH_WORDS = ("node has died", "owner has died", "node died", "preempted")


class ClusterLostError(RuntimeError):
    """The Ray cluster stopped answering; the message is one line."""


class NoWorkerLeftError(RuntimeError):
    """Every worker is gone, or no node of the cluster can hold one; the message is one line."""


def start_failure(error: Exception) -> WorkerStartError | None:
    """The one-line ``WorkerStartError`` of a worker whose creation failed (its ``__init__`` raised: a retry would
    fail the same way), or None for any other failure."""
    if not (isinstance(error, RayActorError) and error.actor_init_failed):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    ours = [
        line.split(f"{WorkerStartError.__name__}: ", 1)[1] for line in lines if f"{WorkerStartError.__name__}: " in line
    ]
    return WorkerStartError(ours[-1] if ours else f"a worker could not start: {lines[-1] if lines else error}")


def lost_to_cluster(error: Exception) -> bool:
    """Whether a Ray error itself says the cluster lost the worker (node, owner or object lost).

    NOTE: not enough on its own: Ray 2.60 reports both a killed worker process and a lost node's in-flight call
    as ``ActorUnavailableError`` ("Socket closed"); the pool asks the cluster whether the worker's node is alive.
    """
    if isinstance(error, CLUSTER_FAILURES):
        return True
    return isinstance(error, ActorDiedError) and (
        error.preempted or any(words in str(error) for words in CLUSTER_DEATH_WORDS)
    )


@dataclass
class Dispatch:
    """A batch on its way through the pool; ``context`` is the caller's, handed back with the outcomes."""

    requests: list[TrialRequest]
    context: Any
    worker: int
    # NOTE: re-sends after the worker died on its own (``attempt``) and after the cluster lost it
    # (``cluster_retries``); neither ever fails the batch.
    attempt: int = 0
    cluster_retries: int = 0
    submitted_at: float = 0.0
    infrastructure: bool = False
    # NOTE: set while the batch waits for its worker to answer again after a failure: the error, the node the
    # worker ran on then (None: not known), and whether that node is known to be lost.
    failure: Exception | None = None
    failed_node: str | None = None
    lost_node: bool = False

    def lost(self, error: str) -> list[TrialOutcome]:
        return [TrialOutcome.unfinished(request, error) for request in self.requests]


class WorkerPool:
    """``count`` workers, each loading ``eval_config`` (and ``test_samples`` more samples per task) once.

    Parameters
    ----------
    eval_config : dict
        ``SweepConfig.worker_config()``: ``EvalConfig.to_dict()`` of the sweep, or of a bounded-cache sweep its
        ``StreamConfig.to_dict()``; each trial replaces its press.
    test_samples : int
        Samples per task each worker holds out for the test stage.
    count, num_cpus, num_gpus : int, float, float
        Workers and the Ray resources each holds.
    max_retries : int
        Ray's restarts of each worker; a worker that dies once more is retired.
    node_wait_s : float
        How long a batch waits for the cluster to have a node that can hold its worker again.
    worker_class : type
        The actor: ``TrialWorker``, or ``StreamTrialWorker`` for a bounded-cache sweep.
    """

    def __init__(
        self,
        eval_config: dict,
        test_samples: int,
        count: int,
        num_cpus: float,
        num_gpus: float,
        max_retries: int,
        node_wait_s: float,
        worker_class: type[TrialWorker] = TrialWorker,
    ):
        self.eval_config, self.test_samples = eval_config, test_samples
        self.remote_worker = ray.remote(worker_class)
        self.resources = dict(num_cpus=num_cpus, num_gpus=num_gpus)
        self.max_retries = max_retries
        self.node_wait_s = node_wait_s
        self.workers: list = [None] * count
        # NOTE: a worker's ``identity()`` asked at its creation, answered before any batch it runs (an actor's
        # calls run in order): the node it runs on, read once a failure needs it.
        self.identities: dict[int, ray.ObjectRef] = {}
        self.node_of: dict[int, str] = {}
        self.retired: set[int] = set()
        self.last_death = ""
        for slot in range(count):
            self._create(slot)
        # NOTE: read now, while the cluster answers: once its GCS is gone, every call into it blocks.
        self.gcs_address = ray.get_runtime_context().gcs_address
        self.idle = list(range(count))
        self.running: dict[ray.ObjectRef, Dispatch] = {}
        # NOTE: a batch whose worker failed waits here, keyed by a ping, until the restarted worker answers.
        self.pinging: dict[ray.ObjectRef, Dispatch] = {}
        self.no_node_since: float | None = None

    @property
    def size(self) -> int:
        return len(self.workers) - len(self.retired)

    @property
    def busy(self) -> int:
        """Trials in flight (not batches)."""
        return sum(len(dispatch.requests) for dispatch in [*self.running.values(), *self.pinging.values()])

    def submit(self, requests: list[TrialRequest], context: Any = None) -> None:
        """Send a batch of ``requests`` to an idle worker (the caller checks ``idle`` first)."""
        self._send(Dispatch(requests, context, self.idle.pop()))

    def wait(self, timeout_s: float = 1.0) -> list[tuple[Dispatch, list[TrialOutcome]]]:
        """The dispatches that ended within ``timeout_s`` (at least one, unless the time ran out), each with one
        outcome per request, in order.

        Raises
        ------
        ClusterLostError, NoWorkerLeftError, WorkerStartError, WorkerStorageError
            The sweep cannot go on; the dispatches in flight stay for ``drain``.
        """
        if not self.size:
            raise NoWorkerLeftError(
                f"no trial worker is left: each died more than {self.max_retries} times "
                f"(workers.max_retries), the last running {self.last_death}"
            )
        ended = []
        in_flight = [*self.running, *self.pinging]
        ready = ray.wait(in_flight, num_returns=1, timeout=timeout_s)[0] if in_flight else []
        if not ready:
            # NOTE: a call to an actor still starting waits on the GCS without ever failing; only a probe tells
            # that the cluster is gone, and only the nodes whether a worker waits for one that cannot come.
            self._check_cluster()
            if self.pinging:
                self._check_capacity()
            if not in_flight:
                time.sleep(timeout_s)
        for reference in ready:
            if reference in self.pinging:
                self._after_ping(reference, ended)
                continue
            # NOTE: a dispatch leaves ``running`` only once the cluster is known to answer, so that a
            # ClusterLostError leaves it for ``drain``.
            dispatch = self.running[reference]
            try:
                outcomes = ray.get(reference)
            except WorkerStorageError as error:
                raise WorkerStorageError(str(getattr(error, "cause", error))) from None
            except (*WORKER_FAILURES, *CLUSTER_FAILURES) as error:
                self._check_cluster(error)
                if (failure := start_failure(error)) is not None:
                    raise failure from None
                del self.running[reference]
                dispatch.failure, dispatch.failed_node = error, self._node(dispatch.worker)
                self._ping(dispatch)
                continue
            del self.running[reference]
            self.idle.append(dispatch.worker)
            ended.append((dispatch, outcomes))
        return ended

    def drain(self) -> list[Dispatch]:
        """Give up every pending dispatch (on a stop) and return them.

        NOTE: what they still return is dropped unread on purpose (the caller re-queues their trials). Ray would log
        each error among it as an "Unhandled error" traceback, after the driver's one-line stop (a second worker's
        ``WorkerStorageError`` on a full disk), so from here on this process ignores them.
        """
        pending = [*self.running.values(), *self.pinging.values()]
        if pending:
            os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"  # read by Ray each time it would log one
        self.running.clear()
        self.pinging.clear()
        return pending

    def _create(self, slot: int) -> None:
        options = dict(**self.resources, max_restarts=self.max_retries, max_task_retries=0)
        self.workers[slot] = self.remote_worker.options(**options).remote(self.eval_config, self.test_samples)
        self.identities[slot] = self.workers[slot].identity.remote()
        self.node_of.pop(slot, None)

    def _node(self, slot: int) -> str | None:
        """The node the worker in ``slot`` last answered from (None: it never did)."""
        reference = self.identities.get(slot)
        if reference is not None and ray.wait([reference], timeout=0)[0]:
            del self.identities[slot]
            try:
                self.node_of[slot] = ray.get(reference).node_id
            except (*WORKER_FAILURES, *CLUSTER_FAILURES):
                pass
        return self.node_of.get(slot)

    def _send(self, dispatch: Dispatch) -> None:
        dispatch.submitted_at = time.time()
        self.running[self.workers[dispatch.worker].evaluate_batch.remote(dispatch.requests)] = dispatch

    def _ping(self, dispatch: Dispatch) -> None:
        self.pinging[self.workers[dispatch.worker].identity.remote()] = dispatch

    def _lost_by_cluster(self, dispatch: Dispatch, error: Exception | None = None) -> bool:
        """Whether the cluster, not the worker's own work, ended the worker ``dispatch`` failed on."""
        errors = [e for e in (dispatch.failure, error) if e is not None]
        return any(lost_to_cluster(e) for e in errors) or (
            dispatch.failed_node is not None and dispatch.failed_node not in alive_nodes()
        )

    def _after_ping(self, reference: ray.ObjectRef, ended: list) -> None:
        dispatch = self.pinging[reference]
        try:
            identity = ray.get(reference)
        except ActorUnavailableError as error:  # still restarting (unless the cluster is gone): ask again shortly
            self._check_cluster(error)
            del self.pinging[reference]
            time.sleep(0.5)
            self._ping(dispatch)
            return
        except (*WORKER_FAILURES, *CLUSTER_FAILURES) as error:  # NOTE: Ray gave up on the worker
            self._check_cluster(error)
            if (failure := start_failure(error)) is not None:
                raise failure from None
            del self.pinging[reference]
            if self._lost_by_cluster(dispatch, error):
                log.warning("%s: worker lost with its node; starting a new one", _trials(dispatch))
                dispatch.lost_node = True
                self._create(dispatch.worker)
                self._ping(dispatch)
                return
            self.retired.add(dispatch.worker)
            self.last_death = f"{_trials(dispatch)}: {_first_line(error)}"
            log.warning(
                "worker %d retired: it died more often than Ray restarts it (%s)", dispatch.worker, self.last_death
            )
            dispatch.infrastructure = True
            ended.append((dispatch, dispatch.lost(f"worker retired: {self.last_death}")))
            return
        del self.pinging[reference]
        self.node_of[dispatch.worker] = identity.node_id
        self.no_node_since = None
        if dispatch.lost_node or self._lost_by_cluster(dispatch):
            dispatch.cluster_retries += 1
            cause = "lost with its node"
        else:
            dispatch.attempt += 1
            cause = "died"
        log.warning("%s: worker %s (%s); retrying", _trials(dispatch), cause, type(dispatch.failure).__name__)
        dispatch.failure, dispatch.failed_node, dispatch.lost_node = None, None, False
        self._send(dispatch)

    def _check_capacity(self) -> None:
        """Raise ``NoWorkerLeftError`` once no node of the cluster could hold a worker for ``node_wait_s``."""
        if any(fits(resources, self.resources) for resources in alive_nodes().values()):
            self.no_node_since = None
            return
        self.no_node_since = self.no_node_since or time.time()
        if time.time() - self.no_node_since > self.node_wait_s:
            wanted = ", ".join(f"{value:g} {ray_resource(name)}s" for name, value in self.resources.items() if value)
            raise NoWorkerLeftError(
                f"no node of the cluster can hold a worker ({wanted}) for "
                f"{self.node_wait_s:g} s (workers.node_wait_s); add one"
            )

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
            raise ClusterLostError(
                f"the Ray cluster at {self.gcs_address} stopped answering ({seen}GCS: {probe.strerror or probe})"
            ) from None


def alive_nodes() -> dict[str, dict]:
    """The cluster's live nodes: node id → its total resources (Ray's names: ``CPU``, ``GPU``)."""
    return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}


def fits(node_resources: dict, wanted: dict) -> bool:
    """Whether a node with ``node_resources`` (Ray's names) could hold a worker asking ``wanted`` (``num_cpus``…)."""
    return all(node_resources.get(ray_resource(name), 0) >= value for name, value in wanted.items())


def ray_resource(option: str) -> str:
    """A worker option's resource as Ray names it on a node: ``num_cpus`` -> ``CPU``, ``num_gpus`` -> ``GPU``."""
    return option.removeprefix("num_").removesuffix("s").upper()


def _trials(dispatch: Dispatch) -> str:
    return ", ".join(map(str, dispatch.requests))


def _first_line(error: Exception | None) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
