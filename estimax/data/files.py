"""Files by name, pattern or list, local or remote, through fsspec.

Owns expanding paths (a path, a glob such as ``data/train-*.tfrecord``, or a
list of either; any fsspec URL: ``gs://``, ``s3://``, ``memory://``, local),
opening and reading byte ranges, and assigning files to processes. On a
store each listing and read has the store's deadline (``storage.bounded``).
Does not own any file format.
"""

from __future__ import annotations

import glob as glob_lib
import gzip
import os
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import fsspec

from estimax import storage
from estimax.errors import InputError, InputNotFoundError


class File(NamedTuple):
    """One file on a filesystem; ``name`` is how errors show it to the user."""

    fs: fsspec.AbstractFileSystem
    path: str
    name: str

    def open(self):
        handle = self.fs.open(self.path, "rb")
        return _CheckedGzip(self.name, handle) if self.path.endswith(".gz") else handle

    def read(self) -> bytes:
        """The whole file, decompressed if ``.gz``; a damaged ``.gz`` is an error naming the file."""
        return storage.bounded("reading", self.name, self._read_whole)

    def _read_whole(self) -> bytes:
        with self.open() as f:
            return f.read()

    def read_range(self, start: int, end: int) -> bytes:
        return storage.bounded("reading", self.name, self.fs.cat_file, self.path, start=start, end=end)

    def size(self) -> int:
        return storage.bounded("reading", self.name, self.fs.size, self.path)


class _CheckedGzip(gzip.GzipFile):
    """A gzip stream whose truncated or corrupt data is an ``InputError`` naming the file."""

    def __init__(self, display: str, handle):
        super().__init__(fileobj=handle)
        self._display = display

    def read(self, size: int | None = -1) -> bytes:
        try:
            return super().read(size)
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise self._error(error) from None

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return super().seek(offset, whence)
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise self._error(error) from None

    def _error(self, error: Exception) -> InputError:
        return InputError(
            f"{self._display}: not a complete gzip file ({type(error).__name__}: {error}); expected the whole "
            "download. Fix: download it again, or gunzip a good copy (`gzip -t FILE` checks a file)."
        )


def expand(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[File]:
    """The files named by ``paths`` (globs expanded and sorted), in order; raises if a
    name matches nothing."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[File] = []
    for pattern in map(storage.expand, paths):
        fs, path = storage.filesystem(pattern)
        matches = storage.bounded("listing", pattern, _matches, fs, path)
        if not matches:
            raise InputNotFoundError(f"Input files {pattern!r} match no file; expected an existing path or pattern.")
        files.extend(File(fs, m, _display(pattern, fs, m)) for m in matches)
    if not files:
        raise InputNotFoundError("Input files: received an empty list; expected at least one path.")
    return files


def _matches(fs, path: str) -> list[str]:
    return sorted(fs.glob(path)) if glob_lib.has_magic(path) else [path] if fs.isfile(path) else []


def listing(directory: str | os.PathLike) -> list[str]:
    """The names of the files in ``directory`` (any fsspec URL); raises if it is not a directory."""
    url = storage.expand(directory)
    fs, path = storage.filesystem(url)
    if not storage.bounded("listing", url, fs.isdir, path):
        raise InputNotFoundError(f"{os.fspath(directory)!r} is not a directory; expected the directory of the files.")
    return [os.path.basename(p.rstrip("/")) for p in storage.bounded("listing", url, fs.ls, path, detail=False)]


def _display(pattern: str, fs, path: str) -> str:
    return path if "://" not in pattern else fs.unstrip_protocol(path)


def for_process(files: list[File], process_index: int, process_count: int) -> list[File] | None:
    """The files process ``process_index`` reads (``i::n``) when there are at least as many
    files as processes; ``None`` when examples must be split within files instead."""
    return files[process_index::process_count] if len(files) >= process_count else None
