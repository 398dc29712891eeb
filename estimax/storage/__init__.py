"""Paths and URLs: a local path, ``file://``, ``gs://``, ``s3://`` or ``memory://``, one way.

Owns turning what a user typed into a usable location (``~`` and ``$VARS``
expanded, a local path made absolute, a URL kept a URL: never ``os.path`` on
a URL, never a local folder named after one), the few file operations estimax
needs on any store (through fsspec, which Orbax's ``etils.epath`` also uses),
a conditional create (the lock), moving a directory (a rename on disk, copy
then delete where a store has none), and checking a bucket before anything
is written, so that a missing client library, credentials, bucket or
permission is one line naming the URL and the fix, and one client per
store (``use_one_client``: ``gs://`` through gcsfs and the emulator the
standard variable names, whatever else is installed).

Every store operation has a deadline (``ESTIMAX_STORE_DEADLINE_SECONDS``,
120 s by default): each request of every client (gcsfs, s3fs, and
TensorStore, which writes Orbax's arrays) gives up after a quarter of it
(``client_options``), and ``bounded`` runs an operation (the file
operations here, a checkpoint restore, a data read) for at most the
deadline, warning while it tries again, then raises one
``StoreUnavailableError`` line naming the store, the operation and how long
it waited. Does not own what is written where (``run_dir.py``) nor the
checkpoint format (Orbax); the model_dir's lease bounds training's own
writes (``lease.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import threading
import time
import uuid

from estimax.errors import ConfigError, StorageError, StoreUnavailableError, one_line
from estimax.records import noise

logger = logging.getLogger("estimax")

# The client library and the extra that installs it, per URL scheme.
CLIENTS = {"gs": ("gcsfs", "estimax[gcs]"), "s3": ("s3fs", "estimax[s3]")}
# The GCS emulator variable of each C++ client: TensorStore's (Orbax's arrays), google-cloud-cpp's (ArrayRecord).
EMULATOR_VARIABLES = ("TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")
DEADLINE_SECONDS = "ESTIMAX_STORE_DEADLINE_SECONDS"  # how long one store operation may take, retries included
DEFAULT_DEADLINE_SECONDS = 120.0  # a slow real bucket, not an emulator
PROBE = ".estimax-probe-"  # the name of the object ``check_store`` writes and deletes
RETRY_FIX = "run the same command again once the store answers (a slow store: raise ESTIMAX_STORE_DEADLINE_SECONDS)"


def use_one_client() -> None:
    """Sends every ``gs://`` access through the clients estimax checks, whatever else is installed.

    With TensorFlow importable, etils.epath (Orbax's paths) would read ``gs://``
    through ``tf.io.gfile``, a second client that ignores ``STORAGE_EMULATOR_HOST``:
    ``EPATH_USE_TF=false`` keeps it on fsspec (gcsfs), as estimax's own files are.
    It must be set before etils first resolves a ``gs://`` path (it caches the
    choice), hence on import. The C++ clients each read their own emulator
    variable: they are derived from ``STORAGE_EMULATOR_HOST``, the one the
    Python clients read, on every store access. A variable already set is kept.
    """
    os.environ.setdefault("EPATH_USE_TF", "false")
    endpoint = _emulator_endpoint()
    if endpoint:
        for variable in EMULATOR_VARIABLES:
            os.environ.setdefault(variable, endpoint)


def _emulator_endpoint() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    return (host if "://" in host else f"http://{host}") if host else None


def quiet_tensorstore(path: str) -> None:
    """Keeps TensorStore's credentials line off the console when ``path`` is on the GCS emulator (its
    endpoint is ``STORAGE_EMULATOR_HOST``'s, which takes anonymous requests); on real GCS it stays."""
    endpoint = _emulator_endpoint()
    if scheme(path) == "gs" and endpoint and os.environ.get(EMULATOR_VARIABLES[0]) == endpoint:
        client_options()  # before TensorStore's first request: it reads its variables once
        noise.quiet_tensorstore_credentials(path.split("/")[2])


def deadline_seconds() -> float:
    """``ESTIMAX_STORE_DEADLINE_SECONDS`` (120 by default): how long one store operation may take."""
    return seconds_from_environment(DEADLINE_SECONDS, DEFAULT_DEADLINE_SECONDS)


def client_options() -> None:
    """Gives every request of every client a quarter of the deadline, so that a stalled store
    (one that accepts connections and answers nothing) fails a request rather than hanging it,
    and ``bounded`` can try again: gcsfs and s3fs through fsspec's configuration (which Orbax's
    paths also read), TensorStore through its curl variables (a transfer under 1 byte/s for that
    long is abandoned; TensorStore then retries by itself). A TensorStore variable already set is kept."""
    import fsspec.config

    seconds = deadline_seconds() / 4
    fsspec.config.conf.setdefault("gcs", {})["requests_timeout"] = seconds
    s3_config = fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {})
    s3_config.update(connect_timeout=seconds, read_timeout=seconds)
    whole = str(max(1, round(seconds)))
    for variable, value in (("TIME_SECONDS", whole), ("LIMIT_BYTES", "1")):
        os.environ.setdefault(f"TENSORSTORE_CURL_LOW_SPEED_{variable}", value)
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", whole)


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
    client_options()  # before the first request: TensorStore reads its variables once
    deadline = deadline_seconds()
    began = time.monotonic()
    while True:
        call = _Call(function, args, kwargs)
        while not call.done.wait(max(0.0, min(deadline / 4, began + deadline - time.monotonic()))):
            waited = time.monotonic() - began
            if waited >= deadline:
                raise _unavailable(operation, path, waited, deadline, "no answer", fix)
            logger.warning("%s: %s: the store has not answered for %.0f s; waiting another %.0f s.",
                           path, operation, waited, deadline - waited)  # fmt: skip
        if call.error is None:
            return call.result
        if isinstance(call.error, StorageError) or not unanswered(call.error):
            raise call.error
        waited = time.monotonic() - began
        if waited >= deadline:
            raise _unavailable(operation, path, waited, deadline, one_line(call.error), fix)
        logger.warning("%s: %s: the store did not answer (%s); trying again for another %.0f s.",
                       path, operation, one_line(call.error), deadline - waited)  # fmt: skip
        time.sleep(min(1.0, deadline - waited))


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


def _unavailable(operation: str, path: str, waited: float, deadline: float, last: str, fix: str):
    return StoreUnavailableError(
        f"{path}: {operation}: the store did not answer for {waited:.0f} s ({last}); expected a store that "
        f"answers within {deadline:g} s ({DEADLINE_SECONDS}). Fix: {fix}."
    )


def _with_deadline(operation: str):
    """Bounds a file operation of this module whose first argument is the path (see ``bounded``)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(path, *args, **kwargs):
            return bounded(operation, path, function, path, *args, **kwargs)

        return wrapper

    return decorate


use_one_client()


def expand(path: str | os.PathLike) -> str:
    """``path`` with ``$VARS`` and (for a local path) ``~`` expanded; ``file://x`` becomes ``x``."""
    text = os.path.expandvars(os.fspath(path))
    if text.startswith("file://"):
        text = text[len("file://") :]
    return text if is_url(text) else os.path.expanduser(text)


def resolve(path: str | os.PathLike) -> str:
    """``expand(path)``, made absolute when local; a URL without its trailing ``/``."""
    text = expand(path)
    return text.rstrip("/") if is_url(text) else os.path.abspath(text)


def scheme(path: str) -> str:
    """``"gs"``, ``"s3"``, ``"memory"``, ...; ``""`` for a local path."""
    head, sep, _ = os.fspath(path).partition("://")
    return head if sep and head.isidentifier() else ""


def is_url(path: str) -> bool:
    return scheme(path) not in ("", "file")


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def name(path: str) -> str:
    """The last component: ``run`` of ``gs://bucket/run`` or ``/tmp/run/``."""
    return (posixpath if is_url(path) else os.path).basename(path.rstrip("/"))


def parent(path: str) -> str:
    return (posixpath if is_url(path) else os.path).dirname(path.rstrip("/"))


def filesystem(path: str):
    """``(fsspec filesystem, path within it)``; a missing client library is a ``StorageError``."""
    import fsspec

    use_one_client()
    client_options()
    noise.quiet_libraries()  # gcsfs warns on every client it makes without credentials (an emulator, anonymously)
    try:
        return fsspec.core.url_to_fs(path)
    except ImportError:
        library, extra = CLIENTS.get(scheme(path), (f"the fsspec backend of {scheme(path)}://", "it"))
        raise StorageError(
            f"{path}: reading and writing {scheme(path)}:// needs {library}, which is not installed. "
            f"Fix: pip install '{extra}'."
        ) from None


@_with_deadline("checking that it exists")
def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


@_with_deadline("listing")
def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    return fs.isdir(inner)


@_with_deadline("listing")
def listdir(path: str) -> list[str]:
    """The names directly under ``path``; ``[]`` when there is nothing. ``check_store``'s probes are
    left out: a store that stalled may have written one after its writer gave up (and never deleted it)."""
    if not is_url(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    with contextlib.suppress(FileNotFoundError):
        names = (posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False))
        return sorted(n for n in names if not n.startswith(PROBE))
    return []


def makedirs(path: str) -> None:
    """A local directory (object stores have no directories: nothing to do)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


@_with_deadline("reading")
def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


@_with_deadline("writing")
def write_bytes(path: str, data: bytes) -> None:
    """Writes ``path`` whole: atomically on disk (a temporary file renamed), one object upload on a store."""
    if not is_url(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
        return
    fs, inner = filesystem(path)
    fs.pipe_file(inner, data)


# No deadline of its own (its requests have their timeouts): a second try, after an answer lost in
# transit, could not tell this process's object from another's.
@contextlib.contextmanager
def writing(path: str):
    """A binary file to write ``path`` through, whole or not at all: on disk a temporary file renamed
    when the block ends without an error, on a store an upload finished then."""
    if is_url(path):
        fs, inner = filesystem(path)
        file = fs.open(inner, "wb")
        try:
            yield file
        except BaseException:
            with contextlib.suppress(Exception):
                file.discard()  # the upload is abandoned: the object is not written
            raise
        file.close()
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as file:
            yield file
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def create_exclusive(path: str, data: bytes) -> bool:
    """Creates ``path`` holding ``data`` unless it exists; ``False`` if it did. Atomic on every store:
    ``O_EXCL`` on disk, ``ifGenerationMatch=0`` on GCS, ``If-None-Match: *`` on S3."""
    if not is_url(path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True
    fs, inner = filesystem(path)
    try:
        fs.pipe_file(inner, data, mode="create")
    except FileExistsError:
        return False
    return True


@_with_deadline("deleting")
def remove(path: str, recursive: bool = False) -> None:
    """Deletes ``path`` (a missing one is no error)."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            if recursive and os.path.isdir(path):
                import shutil

                shutil.rmtree(path)
            else:
                os.remove(path)
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=recursive)
    _forget_listings(fs)


@_with_deadline("moving")
def move(source: str, target: str) -> None:
    """Moves a file or directory: a rename on disk; on an object store, which has no rename,
    a copy then a delete (the source is deleted only once the copy is complete)."""
    if not is_url(source):
        os.rename(source, target)
        return
    fs, inner = filesystem(source)
    _, inner_target = filesystem(target)
    fs.copy(inner, inner_target, recursive=True)
    fs.rm(inner, recursive=True)
    _forget_listings(fs)


def forget_listings(path: str) -> None:
    """Makes the next listing of ``path``'s store ask the store: its client (Orbax's too) caches listings,
    which miss what another process wrote since."""
    if is_url(path):
        _forget_listings(filesystem(path)[0])


def _forget_listings(fs) -> None:
    """Drops the cached listings of every client of ``fs``'s kind (Orbax's included), which would
    otherwise still list what was just moved or deleted."""
    for instance in list(getattr(type(fs), "_cache", {}).values()):
        instance.invalidate_cache()


def upload(local_dir: str, url: str, last: str | None = None) -> None:
    """Copies the files of ``local_dir`` to ``url``; the file named ``last`` goes last, so that a
    reader that finds it finds the rest (object stores have no atomic directory rename)."""
    bounded("uploading", url, _upload, local_dir, url, last)


def _upload(local_dir: str, url: str, last: str | None) -> None:
    fs, inner = filesystem(url)
    files = sorted(
        os.path.relpath(os.path.join(root, f), local_dir) for root, _, names in os.walk(local_dir) for f in names
    )
    for relative in sorted(files, key=lambda f: f == last):
        fs.put_file(os.path.join(local_dir, relative), posixpath.join(inner, *relative.split(os.sep)))


@_with_deadline("downloading")
def download(url: str, local_dir: str) -> str:
    """Copies the objects under ``url`` into ``local_dir``; returns ``local_dir``."""
    fs, inner = filesystem(url)
    fs.invalidate_cache(inner)
    for remote in fs.find(inner):
        target = os.path.join(local_dir, *posixpath.relpath(remote, inner).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(remote, target)
    return local_dir


@_with_deadline("checking the bucket")
def check_store(path: str, *, write: bool) -> None:
    """Raises a one-line ``StorageError`` unless ``path``'s bucket can be used: the client library,
    credentials, the bucket and (with ``write``) permission to write, checked before anything runs."""
    if not is_url(path):
        return
    fs, inner = filesystem(path)
    bucket = inner.split("/", 1)[0]
    probe = f"{inner.rstrip('/')}/{PROBE}{uuid.uuid4().hex[:12]}"
    try:
        if write:
            fs.pipe_file(probe, b"")
            fs.rm(probe)
        elif not fs.exists(bucket):
            raise FileNotFoundError(bucket)  # told below as a StorageError naming the bucket
    except StorageError:
        raise
    except Exception as error:  # the clients' own types: google.auth, botocore, aiohttp, OSError
        if unanswered(error):
            raise  # ``bounded`` tries again
        raise StorageError(f"{path}: {_reason(error, bucket)}") from None


def _reason(error: BaseException, bucket: str) -> str:
    text = f"{type(error).__name__} {error}"
    lowered = text.lower()
    if "credential" in lowered or "could not find default" in lowered or "nocredentials" in lowered:
        return (
            "no credentials were found; expected application default credentials (gs://) or the AWS "
            "variables (s3://). Fix: `gcloud auth application-default login` or GOOGLE_APPLICATION_CREDENTIALS "
            "for gs://; AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or a profile) for s3://."
        )
    if isinstance(error, FileNotFoundError) or "nosuchbucket" in lowered or "not found" in lowered:
        return f"bucket {bucket!r} does not exist (or is not visible). Fix: create it, or correct the URL."
    if isinstance(error, PermissionError) or "403" in text or "denied" in lowered or "forbidden" in lowered:
        return (
            f"permission denied writing to bucket {bucket!r}. Fix: grant this account write access "
            "(e.g. roles/storage.objectUser on GCS, s3:PutObject and s3:DeleteObject on S3), or use "
            "another location."
        )
    return f"the bucket {bucket!r} cannot be used: {text.strip()[:300]}"


# A store that does not answer (these are retried until the deadline); anything else is an answer.
_UNANSWERED = {
    "TimeoutError", "ConnectionError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError",
    "ClientPayloadError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "HttpError", "ProxyError",
}  # fmt: skip


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


def unanswered(error: BaseException) -> bool:
    """Whether ``error`` says the store did not answer (a timeout, a lost connection, a 5xx)."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if isinstance(error, ConnectionError | TimeoutError) or names & (_UNANSWERED - {"HttpError"}):
        return True
    return "HttpError" in names and (getattr(error, "code", 500) or 500) >= 500
