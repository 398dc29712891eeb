"""Deadlines on store operations: how long one may take, and trying again until then.

Every store operation has a deadline (``ESTIMAX_STORE_DEADLINE_SECONDS``, 120 s
by default). ``Deadline`` is the one retry-until-deadline rule: after a try
that the store did not answer (``unanswered``), a warning and a pause while
time is left, else one ``StoreUnavailableError`` line naming the store, the
operation, how long it waited and the fix. ``bounded`` runs an operation under
it on a thread of its own, so that a call blocked on a silent store is
abandoned; the model_dir's lease (``lease.py``) takes, keeps and releases its
lock under the same rule. Does not own the clients' request timeouts
(``clients.py``, set here before the first request) nor what an operation does.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

from estimax.errors import ConfigError, StorageError, StoreUnavailableError, one_line
from estimax.storage.clients import client_options
from estimax.storage.paths import is_url

logger = logging.getLogger("estimax")

DEADLINE_SECONDS = "ESTIMAX_STORE_DEADLINE_SECONDS"  # how long one store operation may take, retries included
DEFAULT_DEADLINE_SECONDS = 120.0  # a slow real bucket, not an emulator
RETRY_FIX = "run the same command again once the store answers (a slow store: raise ESTIMAX_STORE_DEADLINE_SECONDS)"


def deadline_seconds() -> float:
    """``ESTIMAX_STORE_DEADLINE_SECONDS`` (120 by default): how long one store operation may take."""
    return seconds_from_environment(DEADLINE_SECONDS, DEFAULT_DEADLINE_SECONDS)


def seconds_from_environment(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={text!r}; expected a positive number of seconds. Fix: e.g. {name}={default:g}.")
    return value


@dataclasses.dataclass(frozen=True)
class Deadline:
    """``operation`` on ``path`` may take ``seconds`` from ``began`` (``time.monotonic()``), tries included."""

    operation: str
    path: str
    seconds: float
    began: float = dataclasses.field(default_factory=time.monotonic)
    fix: str = RETRY_FIX

    def left(self) -> float:
        return self.began + self.seconds - time.monotonic()

    def unavailable(self, last: str) -> StoreUnavailableError:
        """The one line at the deadline; ``last``: what the last try met."""
        waited = time.monotonic() - self.began
        return StoreUnavailableError(
            f"{self.path}: {self.operation}: the store did not answer for {waited:.0f} s ({last}); expected a store "
            f"that answers within {self.seconds:g} s ({DEADLINE_SECONDS}). Fix: {self.fix}."
        )

    def pause_before_retry(self, error: BaseException, most: float, until: str = "") -> float:
        """After a try the store did not answer (``error``): the pause before the next, at most ``most``
        seconds, with a warning (``until``: what happens at the deadline); ``StoreUnavailableError`` once
        the deadline has passed."""
        left = self.left()
        if left <= 0:
            raise self.unavailable(one_line(error)) from None
        logger.warning("%s: %s: the store did not answer (%s); trying again for another %.0f s%s.",
                       self.path, self.operation, one_line(error), left, until)  # fmt: skip
        return min(most, left)


def bounded(operation: str, path: str, function, *args, fix: str = RETRY_FIX, **kwargs):
    """``function(*args, **kwargs)`` given at most the deadline when ``path`` is on a store.

    It runs on a thread of its own, so that a call blocked on a store that does not answer
    is abandoned (it ends with its request timeout); one that failed because the store did
    not answer is tried again. A warning says so each quarter of the deadline; at the
    deadline, one ``StoreUnavailableError`` line naming ``path``, ``operation``, the wait
    and ``fix``. Any other error is the function's own. Within another bounded operation it
    runs as it is: the outer one bounds it, and its failure is the outer one's to report.
    """
    if not is_url(path) or getattr(_bounding, "active", False):
        return function(*args, **kwargs)
    client_options(deadline_seconds())  # before the first request: TensorStore reads its variables once
    deadline = Deadline(operation, path, deadline_seconds(), fix=fix)
    while True:
        call = _Call(function, args, kwargs)
        while not call.done.wait(max(0.0, min(deadline.seconds / 4, deadline.left()))):
            if deadline.left() <= 0:
                raise deadline.unavailable("no answer")
            waited = time.monotonic() - deadline.began
            logger.warning("%s: %s: the store has not answered for %.0f s; waiting another %.0f s.",
                           path, operation, waited, deadline.left())  # fmt: skip
        if call.error is None:
            return call.result
        if isinstance(call.error, StorageError) or not unanswered(call.error):
            raise call.error
        time.sleep(deadline.pause_before_retry(call.error, 1.0))


_bounding = threading.local()  # ``active`` on the thread of a bounded operation


class _Call:
    """A function running on a daemon thread: a process may end while it is blocked."""

    def __init__(self, function, args, kwargs):
        self.result, self.error, self.done = None, None, threading.Event()
        threading.Thread(target=self._run, args=(function, args, kwargs), name="estimax-store", daemon=True).start()

    def _run(self, function, args, kwargs) -> None:
        _bounding.active = True
        try:
            self.result = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self.error = error
        self.done.set()


def with_deadline(operation: str):
    """Bounds a file operation whose first argument is the path (see ``bounded``)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(path, *args, **kwargs):
            return bounded(operation, path, function, path, *args, **kwargs)

        return wrapper

    return decorate


# A store that does not answer (these are retried until the deadline); anything else is an answer.
_UNANSWERED = {
    "TimeoutError", "ConnectionError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError",
    "ClientPayloadError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "HttpError", "ProxyError",
}  # fmt: skip


def unanswered(error: BaseException) -> bool:
    """Whether ``error`` says the store did not answer (a timeout, a lost connection, a 5xx)."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if isinstance(error, ConnectionError | TimeoutError) or names & (_UNANSWERED - {"HttpError"}):
        return True
    return "HttpError" in names and (getattr(error, "code", 500) or 500) >= 500
