"""Bounded retries around MLflow calls: a tracking server that is down for a moment is waited for, one that stays
down stops the sweep with one sentence (``TrackingUnavailableError``) instead of a client traceback."""

from __future__ import annotations

import functools
import logging
import re
import time
from dataclasses import dataclass

from mlflow.exceptions import MlflowException

log = logging.getLogger("grkv.sweep")


class TrackingUnavailableError(RuntimeError):
    """The MLflow tracking server cannot be reached (at the start, or any longer mid-sweep)."""


def one_line(error: BaseException, limit: int = 200) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters; its type's name when it has none."""
    message = str(error).strip()
    return message.splitlines()[0][:limit] if message else type(error).__name__


def unreachable_reason(error: BaseException) -> str:
    """What an MLflow client error says went wrong, short: the server, the endpoint and the root cause
    ("http://127.0.0.1:5000 runs/update: Connection refused") instead of the client's whole chain of exceptions.

    NOTE: MLflow words it "API request to <url> failed with exception <urllib3's chain>"; the root cause is the
    innermost "[Errno N] <text>" or the last "…: <text>" of the chain.
    """
    message = one_line(error, limit=2000)
    request = re.match(r"API request to (\S*?)/api/\d\.\d/mlflow/(\S+) failed", message)
    if request is None:
        return one_line(error)
    cause = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", message) or re.findall(r"(Read timed out|timed out)", message)
    return f"{request.group(1)} {request.group(2)}: {cause[-1].strip() if cause else 'no answer'}"


def is_transient(error: Exception) -> bool:
    """Whether an MLflow client error says the server is unreachable or failing (worth a retry), not that the
    request itself was wrong.

    NOTE: MLflow's REST client reports a refused connection, a timeout and a non-JSON error response all as an
    ``MlflowException`` whose message starts "API request to"; a server error with a JSON body carries HTTP 5xx.
    """
    if not isinstance(error, MlflowException):
        return False
    return str(error).startswith("API request to") or error.get_http_status_code() >= 500


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more tries of a call that failed transiently, waiting ``backoff_s`` before the first and twice
    as long before each next one."""

    retries: int
    backoff_s: float

    def call(self, function, *args, what: str, **kwargs):
        """``function(*args, **kwargs)``, retried; ``TrackingUnavailableError`` naming ``what`` once the tries are
        spent. Errors that are not transient are raised as they are."""
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return function(*args, **kwargs)
            except MlflowException as error:
                if not is_transient(error):
                    raise
                reason = unreachable_reason(error)
                if attempt == self.retries:
                    raise TrackingUnavailableError(
                        f"MLflow {what} failed {attempt + 1} time(s) over {time.monotonic() - started:.0f} s ({reason})"
                    ) from None
                wait_s = self.backoff_s * 2**attempt
                log.warning("MLflow %s failed (%s); retrying in %.1f s", what, reason, wait_s)
                time.sleep(wait_s)


class RetryingClient:
    """An ``MlflowClient`` whose every method goes through ``policy``."""

    def __init__(self, client, policy: RetryPolicy):
        self._client = client
        self._policy = policy

    def retried(self, function, *args, what: str, **kwargs):
        """``function(*args, **kwargs)`` (a call to MLflow not made through the client), retried as its calls are."""
        return self._policy.call(function, *args, what=what, **kwargs)

    def __getattr__(self, name: str):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        return functools.partial(self._policy.call, attribute, what=name)
