"""Keeps the libraries' chatter off the console, never estimax's own messages.

Orbax logs through absl: warnings for things that are expected here (a
read-only view of a checkpoint directory, metadata that a damaged checkpoint
lacks), and, when a background save fails, errors whose failure estimax
raises itself as one line (a full disk names the directory and the last good
checkpoint). Orbax's background event loop can also report "Event loop is
closed" from a thread, a callback or a destructor once its work is done. Only
these are filtered; other libraries' messages pass.
"""

from __future__ import annotations

import logging
import sys
import threading

_CLOSED = "Event loop is closed"


def _is_closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == _CLOSED


class _OrbaxChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "orbax" not in record.pathname  # its failures reach the caller as exceptions


class _NoCredentials(logging.Filter):
    """gcsfs warns on every call that it found no credentials, then goes on anonymously (which an
    emulator or a public bucket accepts); a real permission problem reaches the caller as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "credentials were not found" not in message and "unavailable metadata server" not in message


class _ClosedLoop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            (record.exc_info and _is_closed_loop(record.exc_info[1]))
            or _CLOSED in record.getMessage()
            or _unretrieved_full_disk(record)
        )


def _unretrieved_full_disk(record: logging.LogRecord) -> bool:
    """asyncio's "Future exception was never retrieved" for a save that failed on a full disk: the
    checkpoint's own one-line error (``CheckpointError``) has said it already."""
    text = record.getMessage() + (repr(record.exc_info[1]) if record.exc_info else "")
    return "never retrieved" in text and ("No space left on device" in text or "os_error_code='28'" in text)


def _unraisable(previous):
    def hook(unraisable) -> None:
        if not _is_closed_loop(unraisable.exc_value):
            previous(unraisable)

    return hook


def _thread_exception(previous):
    def hook(args) -> None:
        if not _is_closed_loop(args.exc_value):
            previous(args)

    return hook


def quiet_libraries() -> None:
    """Installs the filters once per process."""
    absl = logging.getLogger("absl")
    if any(isinstance(f, _OrbaxChatter) for f in absl.filters):  # installed already
        return
    absl.addFilter(_OrbaxChatter())
    logging.getLogger("gcsfs").addFilter(_NoCredentials())
    logging.getLogger("google.auth._default").addFilter(_NoCredentials())
    logging.getLogger("asyncio").addFilter(_ClosedLoop())
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    threading.excepthook = _thread_exception(threading.excepthook)
