"""Keeps the libraries' chatter off the console, never estimax's own messages.

Orbax logs through absl: warnings for things that are expected here (a
read-only view of a checkpoint directory, metadata that a damaged checkpoint
lacks), and, when a background save fails, errors whose failure estimax
raises itself as one line (a full disk names the directory and the last good
checkpoint). Orbax's background event loop can also report "Event loop is
closed" from a thread, a callback or a destructor once its work is done. gcsfs
logs a traceback for each request it gives up on, and fsspec's read-ahead
(``fsspec.prefetcher``) one for each read that failed: errors their callers
get and estimax reports. Only these are filtered; other libraries' messages
pass.

TensorStore (Orbax's arrays on ``gs://``) looks for Google credentials once
per process and, finding none, writes an error line from C++ straight to the
console, which no Python setting reaches. Against a GCS emulator (the
``STORAGE_EMULATOR_HOST`` endpoint, which takes anonymous requests) that line
is noise: ``quiet_tensorstore_credentials`` has TensorStore look once with
the console's file descriptor held, then writes back everything but that
line. Against real GCS the line stays: there, it names a real problem.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import tempfile
import threading

_CLOSED = "Event loop is closed"
# TensorStore's line when no Google credentials are found (google_auth_provider.cc).
NO_CREDENTIALS = b"Could not find the credentials file"
CREDENTIALS_LOOKUP_SECONDS = 2.0  # at most this long with the console held (a lookup takes milliseconds)
_HOLDING = threading.Lock()  # one hold of file descriptor 2 at a time: a second would restore the first's file


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


class _GivenUp(logging.Filter):
    """gcsfs logs each request it gives up on (a store that went away: after about 30 s of retries) with
    its traceback, then raises the error to its caller, where estimax says it: as a warning while it
    tries again, then as one ``StoreUnavailableError`` line at its deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "out of retries on exception" not in message and "non-retriable exception" not in message


class _ReadAheadErrors(logging.Filter):
    """fsspec's read-ahead logs each failed read (with its traceback, several times over: the producer,
    the consumer, the fetch) and raises it to the reader, where estimax says it. Its warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


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
    logging.getLogger("gcsfs").addFilter(_GivenUp())
    logging.getLogger("fsspec.prefetcher").addFilter(_ReadAheadErrors())
    logging.getLogger("google.auth._default").addFilter(_NoCredentials())
    logging.getLogger("asyncio").addFilter(_ClosedLoop())
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    threading.excepthook = _thread_exception(threading.excepthook)


@functools.cache  # TensorStore keeps what it found for the rest of the process
def quiet_tensorstore_credentials(bucket: str) -> None:
    """Has TensorStore look for credentials once (a read of a missing object in ``bucket``, on the
    emulator's endpoint) with its credentials line kept off the console. Call only with an emulator."""
    import tensorstore as ts

    spec = {"driver": "gcs", "bucket": bucket, "context": {"gcs_request_retries": {"max_retries": 1}}}
    with _console_without(NO_CREDENTIALS):
        try:
            store = ts.KvStore.open(spec).result(timeout=CREDENTIALS_LOOKUP_SECONDS)
            store.read(".estimax-credentials-lookup").result(timeout=CREDENTIALS_LOOKUP_SECONDS)
        except Exception:  # noqa: BLE001 - the store's own faults are the checkpoint's to report
            return


@contextlib.contextmanager
def _console_without(marker: bytes):
    """Runs the block with file descriptor 2 in a temporary file, then writes what it held to the console
    less the lines containing ``marker``: another thread's lines in the meantime come late, never lost."""
    with _HOLDING, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        console = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(console, 2)
            os.close(console)
            held.seek(0)
            kept = memoryview(b"".join(line for line in held if marker not in line))
            while kept:
                kept = kept[os.write(2, kept) :]
