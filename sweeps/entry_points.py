"""What the sweep service's two entry points share: the driver (``sweep.py``, run by ``ray job submit``) and the
``grkv`` command line (``sweeps.cli``). Both set the same process environment before they import Ray or MLflow
(``set_service_environment``) and end with statuses from one table.

NOTE: this module imports nothing heavy: each entry point imports it first, before anything that reads the
environment it sets.
"""

from __future__ import annotations

import os
from pathlib import Path

from grkv_core.command_runtime import EXIT_USER_ERROR

# Where a sweep keeps its state on this machine unless told otherwise: the local stack (``<home>/local``, also
# infra/local/common.sh's default), ``grkv demo``'s (``<home>/demo``) and each sweep's journal, results and
# checkpoints (``<home>/sweeps/<sweep-id>``, ``storage.state_dir``).
# NOTE: a folder of the user's, never the checkout: git would see what a sweep writes there, and
# ``ray job submit --working-dir .`` would upload it with every job.
GRKV_HOME = Path("~/.grkv")

# How many times MLflow's own client retries a request that found the server unreachable (its default retries for
# minutes; both entry points fail fast instead).
# NOTE: the driver retries every MLflow call itself (``tracking.retries``, ``tracking.retry_backoff_s``), so the
# client's own retries are off there: one bound, defined in the sweep config.
DRIVER_MLFLOW_RETRIES = 0
# NOTE: the ``grkv`` commands (report, export, a sweep's progress lines) use a plain client after checking the
# server; two client retries keep one dropped request from ending a command.
COMMAND_MLFLOW_RETRIES = 2


def set_service_environment(mlflow_retries: int) -> None:
    """Set what Ray and MLflow read from the environment, where the user has not set it already, and MLflow's client
    retries in any case.

    ``mlflow_retries``: ``DRIVER_MLFLOW_RETRIES`` or ``COMMAND_MLFLOW_RETRIES``, the one setting in which the two
    entry points differ.

    NOTE: the retries are each entry point's own, never inherited: ``grkv sweep`` starts the local Ray head from its
    own environment, so a driver that kept an inherited value would retry beyond the bound its config sets.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # NOTE: Ray >= 2.52 switches to token auth when a token file exists unless told otherwise; say it explicitly.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(mlflow_retries)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


# The exit statuses, one table for both entry points: a status means the same for every command that returns it,
# except 4 (its two names say which command returns which meaning).
SUCCESS = 0
# A config or command line that cannot be used; the library's ``grkv`` commands return the same.
USER_ERROR = EXIT_USER_ERROR
# A service (the Ray cluster, the MLflow server, the Optuna storage, the state directory) unusable at the start or
# lost on the way; a sweep can be resumed once it is back.
SERVICE_LOST = 3
# sweep.py: another driver runs this sweep.
SWEEP_BUSY = 4
# grkv report, grkv export: MLflow has no sweep by that id.
SWEEP_NOT_FOUND = 4
# The sweep stopped before its end (a signal, ``ray job stop``); running it again resumes it.
STOPPED = 5
