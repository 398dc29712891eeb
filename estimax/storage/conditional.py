"""One small object on a bucket, written only while it is still the version the writer last saw.

Owns the conditional calls the model_dir's lease needs, on the stores that have
them: create-if-absent, replace-if-unchanged and delete-if-unchanged, by GCS
generation (``ifGenerationMatch``) or S3 ETag (``If-None-Match: *``,
``If-Match``), and a read that returns the object with its version. Every call
waits at most ``timeout`` seconds, the client's own retries included, then
raises ``TimeoutError``. Does not own what the object holds nor when it is
written (``lease.py``).
"""

from __future__ import annotations

import json
from urllib.parse import quote

from fsspec.asyn import sync
from fsspec.exceptions import FSTimeoutError

from estimax import storage
from estimax.errors import StorageError


def _bounded(loop, function, *args, timeout: float, **kwargs):
    """``function(*args, **kwargs)`` run on the client's event loop, cancelled after ``timeout`` seconds."""
    try:
        return sync(loop, function, *args, timeout=timeout, **kwargs)
    except FSTimeoutError:
        raise TimeoutError(f"no answer within {timeout:g} s") from None  # the lease reads this class as silence


class Changed(Exception):
    """The object is no longer the version the caller named: another writer replaced or deleted it."""


def open_object(url: str) -> GCSObject | S3Object:
    kind = storage.scheme(url)
    fs, inner = storage.filesystem(url)
    if kind == "gs":
        return GCSObject(fs, inner)
    if kind == "s3":
        return S3Object(fs, inner)
    raise StorageError(
        f"{url}: {kind}:// has no conditional writes, which the model_dir's lock needs to keep one writer; "
        "expected gs:// or s3://. Fix: use one of them, or a local path."
    )


class GCSObject:
    """An object on GCS; its version is the generation."""

    def __init__(self, fs, inner: str):
        self.fs = fs
        self.bucket, self.key = inner.split("/", 1)
        self._object = f"{fs._location}/storage/v1/b/{quote(self.bucket)}/o/{quote(self.key, safe='')}"

    def read(self, timeout: float) -> tuple[bytes, str] | None:
        try:
            headers, content = _bounded(self.fs.loop, self.fs._call, "GET", self._object, alt="media", timeout=timeout)
        except FileNotFoundError:
            return None
        return content, headers["x-goog-generation"]

    def create(self, data: bytes, timeout: float) -> str | None:
        try:
            return self._upload(data, "0", timeout)
        except Changed:
            return None

    def replace(self, data: bytes, version: str, timeout: float) -> str:
        return self._upload(data, version, timeout)

    def delete(self, version: str, timeout: float) -> None:
        try:
            _bounded(self.fs.loop, self.fs._call, "DELETE", self._object, ifGenerationMatch=version, timeout=timeout)
        except (FileExistsError, FileNotFoundError):  # gcsfs raises FileExistsError for 412
            raise Changed from None

    def _upload(self, data: bytes, generation: str, timeout: float) -> str:
        # A multipart upload, as gcsfs makes: the emulator checks preconditions on this kind only.
        metadata = json.dumps({"name": self.key})
        body = (
            (
                f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{metadata}\n"
                "--==0==\nContent-Type: application/octet-stream\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )
        try:
            result = _bounded(
                self.fs.loop, self.fs._call, "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                uploadType="multipart", ifGenerationMatch=generation, data=body, json_out=True,
                headers={"Content-Type": 'multipart/related; boundary="==0=="'}, timeout=timeout,
            )  # fmt: skip
        except FileExistsError:  # 412: not that generation
            raise Changed from None
        return str(result["generation"])


class S3Object:
    """An object on S3; its version is the ETag."""

    def __init__(self, fs, inner: str):
        self.fs = fs
        self.bucket, self.key = inner.split("/", 1)

    def read(self, timeout: float) -> tuple[bytes, str] | None:
        async def get():
            response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with response["Body"] as body:
                return await body.read(), response["ETag"]

        try:
            return _bounded(self.fs.loop, get, timeout=timeout)
        except FileNotFoundError:
            return None

    def create(self, data: bytes, timeout: float) -> str | None:
        try:
            return self._call("put_object", timeout, Body=data, IfNoneMatch="*")["ETag"]
        except Changed:
            return None

    def replace(self, data: bytes, version: str, timeout: float) -> str:
        return self._call("put_object", timeout, Body=data, IfMatch=version)["ETag"]

    def delete(self, version: str, timeout: float) -> None:
        self._call("delete_object", timeout, IfMatch=version)

    def _call(self, method: str, timeout: float, **kwargs) -> dict:
        try:
            return _bounded(
                self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, timeout=timeout, **kwargs
            )
        except (FileExistsError, FileNotFoundError) as error:  # If-None-Match failed; If-Match on a deleted object
            if _code(error) == "NoSuchBucket":
                raise  # no bucket: the caller names it
            raise Changed from None
        except OSError as error:
            if _code(error) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise Changed from None
            raise


def _code(error: BaseException) -> str | None:
    """The S3 error code behind an s3fs error (``NoSuchBucket``, ``PreconditionFailed``, ...)."""
    return getattr(error.__cause__, "response", {}).get("Error", {}).get("Code")
