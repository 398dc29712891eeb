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
standard variable names, whatever else is installed). Does not own what is
written where (``run_dir.py``) nor the checkpoint format (Orbax).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid

from estimax.errors import StorageError

# The client library and the extra that installs it, per URL scheme.
CLIENTS = {"gs": ("gcsfs", "estimax[gcs]"), "s3": ("s3fs", "estimax[s3]")}
# The GCS emulator variable of each C++ client: TensorStore's (Orbax's arrays), google-cloud-cpp's (ArrayRecord).
EMULATOR_VARIABLES = ("TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")


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
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host:
        endpoint = host if "://" in host else f"http://{host}"
        for variable in EMULATOR_VARIABLES:
            os.environ.setdefault(variable, endpoint)


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
    try:
        return fsspec.core.url_to_fs(path)
    except ImportError:
        library, extra = CLIENTS.get(scheme(path), (f"the fsspec backend of {scheme(path)}://", "it"))
        raise StorageError(
            f"{path}: reading and writing {scheme(path)}:// needs {library}, which is not installed. "
            f"Fix: pip install '{extra}'."
        ) from None


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    return fs.isdir(inner)


def listdir(path: str) -> list[str]:
    """The names directly under ``path``; ``[]`` when there is nothing."""
    if not is_url(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    with contextlib.suppress(FileNotFoundError):
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False))
    return []


def makedirs(path: str) -> None:
    """A local directory (object stores have no directories: nothing to do)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


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
    fs, inner = filesystem(url)
    files = sorted(
        os.path.relpath(os.path.join(root, f), local_dir) for root, _, names in os.walk(local_dir) for f in names
    )
    for relative in sorted(files, key=lambda f: f == last):
        fs.put_file(os.path.join(local_dir, relative), posixpath.join(inner, *relative.split(os.sep)))


def download(url: str, local_dir: str) -> str:
    """Copies the objects under ``url`` into ``local_dir``; returns ``local_dir``."""
    fs, inner = filesystem(url)
    fs.invalidate_cache(inner)
    for remote in fs.find(inner):
        target = os.path.join(local_dir, *posixpath.relpath(remote, inner).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(remote, target)
    return local_dir


def check_store(path: str, *, write: bool) -> None:
    """Raises a one-line ``StorageError`` unless ``path``'s bucket can be used: the client library,
    credentials, the bucket and (with ``write``) permission to write, checked before anything runs."""
    if not is_url(path):
        return
    fs, inner = filesystem(path)
    bucket = inner.split("/", 1)[0]
    probe = f"{inner.rstrip('/')}/.estimax-probe-{uuid.uuid4().hex[:12]}"
    try:
        if write:
            fs.pipe_file(probe, b"")
            fs.rm(probe)
        elif not fs.exists(bucket):
            raise FileNotFoundError(bucket)
    except StorageError:
        raise
    except Exception as error:  # the clients' own types: google.auth, botocore, aiohttp, OSError
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
