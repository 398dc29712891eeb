"""The few file operations estimax needs, on a local disk or any store, through fsspec.

Owns reading, writing (whole or not at all), listing, deleting and moving
files and directories (a rename on disk, copy then delete where a store has
none), uploading and downloading a folder, the fsspec client of a URL (a
missing client library is one line naming the extra to install), and checking
a bucket before anything is written, so that missing credentials, a missing
bucket or permission is one line naming the URL and the fix. Every operation
on a store is bounded by the store's deadline (``deadlines.py``). Does not own
what is written where (``run_dir.py``), the checkpoint format (Orbax), nor
conditional writes (``conditional.py``). ``quiet_tensorstore`` keeps TensorStore's
credentials line off the console on the GCS emulator.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid

from estimax.errors import StorageError
from estimax.storage import noise
from estimax.storage.clients import CLIENTS, EMULATOR_VARIABLES, client_options, emulator_endpoint, use_one_client
from estimax.storage.deadlines import bounded, deadline_seconds, unanswered, with_deadline
from estimax.storage.paths import is_url, scheme

PROBE = ".estimax-probe-"  # the name of the object ``check_store`` writes and deletes


def quiet_tensorstore(path: str) -> None:
    """Keeps TensorStore's credentials line off the console when ``path`` is on the GCS emulator (its
    endpoint is ``STORAGE_EMULATOR_HOST``'s, which takes anonymous requests); on real GCS it stays."""
    endpoint = emulator_endpoint()
    if scheme(path) == "gs" and endpoint and os.environ.get(EMULATOR_VARIABLES[0]) == endpoint:
        client_options(deadline_seconds())  # before TensorStore's first request: it reads its variables once
        noise.quiet_tensorstore_credentials(path.split("/")[2])


def filesystem(path: str):
    """``(fsspec filesystem, path within it)``; a missing client library is a ``StorageError``."""
    import fsspec

    use_one_client()
    client_options(deadline_seconds())
    noise.quiet_libraries()  # gcsfs warns on every client it makes without credentials (an emulator, anonymously)
    try:
        return fsspec.core.url_to_fs(path)
    except ImportError:
        library, extra = CLIENTS.get(scheme(path), (f"the fsspec backend of {scheme(path)}://", "it"))
        raise StorageError(
            f"{path}: reading and writing {scheme(path)}:// needs {library}, which is not installed. "
            f"Fix: pip install '{extra}'."
        ) from None


@with_deadline("checking that it exists")
def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


@with_deadline("listing")
def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    return fs.isdir(inner)


@with_deadline("listing")
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


@with_deadline("reading")
def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


@with_deadline("writing")
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


@with_deadline("deleting")
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


@with_deadline("moving")
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


@with_deadline("downloading")
def download(url: str, local_dir: str) -> str:
    """Copies the objects under ``url`` into ``local_dir``; returns ``local_dir``."""
    fs, inner = filesystem(url)
    fs.invalidate_cache(inner)
    for remote in fs.find(inner):
        target = os.path.join(local_dir, *posixpath.relpath(remote, inner).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(remote, target)
    return local_dir


@with_deadline("checking the bucket")
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
