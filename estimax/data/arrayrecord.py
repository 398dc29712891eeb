"""ArrayRecord files of ``tf.train.Example``: the format Grain, TFDS and MaxText read.

Owns opening ArrayRecord files with the format's own reader (local files and
``gs://``, at the GCS emulator ``STORAGE_EMULATOR_HOST`` names, if any; files
on other fsspec stores are copied to a local directory first, since the reader
opens nothing else), counting and reading their records by position, a
writer, and the ``array_record`` source: a Grain ``MapDataset`` over every
record of the files, parsed by the same ``Feature`` spec as TFRecord files
(``tfrecord.Parser``). Errors name the file and the record. Does not own the
``tf.train.Example`` message nor the epochs, shuffling and per-process shards
(``tfrecord``, ``grain.MapSource``).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import tempfile
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from typing import Any

import grain

from estimax import storage
from estimax.data import files as files_lib
from estimax.data import tfrecord
from estimax.data.grain import MapSource, file_source
from estimax.data.tfrecord import Parser, serialize
from estimax.errors import ConfigError, ConfigTypeError, InputError, InputIndexError, StorageError

# Random access: no read-ahead past the record asked for, no thread pool per reader (Grain's choice).
READ_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
# One record per chunk, so that reading one record decompresses only that record.
WRITE_OPTIONS = "group_size:1"
_FIX = "Fix: write the file again with ex.data.array_record.write (or ArrayRecordWriter), or copy it again."


def _module():
    from array_record.python import array_record_module  # Linux wheels come with grain

    return array_record_module


def _status(reader) -> str:
    """The reader's error, which it reports only on ``close()``."""
    try:
        reader.close()
    except RuntimeError as error:
        return str(error) or "truncated, or not an ArrayRecord file"
    return "unknown error"


def open_reader(name: str, path: str):
    """A reader of the ArrayRecord file ``path`` (shown as ``name``); an unreadable file is an error."""
    if storage.scheme(path) == "gs":
        storage.use_one_client()  # the reader's own GCS client reads its own emulator variable
    reader = _module().ArrayRecordReader(path, READ_OPTIONS)
    if not reader.ok():
        access = " that Google credentials on this machine may read" if storage.scheme(path) == "gs" else ""
        raise InputError(
            f"{name}: cannot be opened as an ArrayRecord file ({_status(reader)}); expected a complete file "
            f"written by ArrayRecordWriter{access}. {_FIX}"
        )
    return reader


def count_records(name: str, path: str) -> int:
    reader = open_reader(name, path)
    try:
        return int(reader.num_records())
    finally:
        reader.close()


class Catalog:
    """Where each file is read from (its own path, or a local copy) and how many records it holds.

    Shared by the shards of one source; built in the main process, before
    any Grain worker starts.
    """

    def __init__(self, files: Sequence[files_lib.File]):
        self._copies: tempfile.TemporaryDirectory | None = None  # removed with the catalog
        self.paths = {f.name: self._readable(f) for f in files}
        with futures.ThreadPoolExecutor(min(32, len(files))) as pool:  # one round trip per file on gs://
            counts = pool.map(lambda f: count_records(f.name, self.paths[f.name]), files)
            self.counts = dict(zip((f.name for f in files), counts, strict=True))

    def _readable(self, file: files_lib.File) -> str:
        if storage.scheme(file.name) in ("", "gs"):  # the reader opens these itself
            return file.name
        if self._copies is None:
            self._copies = tempfile.TemporaryDirectory(prefix="estimax-arrayrecord-")
        digest = hashlib.sha1(file.name.encode()).hexdigest()[:12]
        local = os.path.join(self._copies.name, f"{digest}-{os.path.basename(file.path)}")
        file.fs.get_file(file.path, local)
        return local

    def __getstate__(self):
        return {**self.__dict__, "_copies": None}  # the main process owns (and removes) the copies


class Records:
    """Every record of ``files`` in order, by position: a Grain ``RandomAccessDataSource``.

    Items are ``(file name, record index in its file, bytes)``, as
    ``tfrecord.Records`` gives them. A reader per file is opened on first
    use in each process (readers are not pickled to Grain workers) and
    shared by Grain's read threads (the reader is thread-safe).
    """

    def __init__(self, files: Sequence[files_lib.File], catalog: Catalog):
        self.names = [f.name for f in files]
        self.catalog = catalog
        self._starts = [0]
        for name in self.names:
            self._starts.append(self._starts[-1] + catalog.counts[name])
        self._readers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._starts[-1]

    def _reader(self, name: str):
        if name not in self._readers:
            with self._lock:
                if name not in self._readers:
                    self._readers[name] = open_reader(name, self.catalog.paths[name])
        return self._readers[name]

    def __getitem__(self, position: int):
        position = int(position)
        if not 0 <= position < len(self):
            raise InputIndexError(  # an IndexError too: iteration by position ends there
                f"Record {position} of an ArrayRecord source of {len(self)} records; expected 0 to {len(self) - 1}."
            )
        file_number = bisect.bisect_right(self._starts, position) - 1
        name, record = self.names[file_number], position - self._starts[file_number]
        try:
            (data,) = self._reader(name).read([record])
        except (RuntimeError, IndexError) as error:  # riegeli's checks: chunk hashes, sizes
            raise InputError(f"{name}: record {record} cannot be read ({error}). {_FIX}") from None
        return name, record, data

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_readers"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def write(path: str | os.PathLike, examples: Iterable[Mapping[str, Any]], *, options: str = WRITE_OPTIONS) -> None:
    """Writes ``{name: values}`` examples to an ArrayRecord file as ``tf.train.Example`` records.

    Values are encoded as ``tfrecord.serialize`` says (floats, integers,
    ``bytes``). ``options`` are the writer's (``group_size:1`` by default,
    which random access wants; e.g. ``"group_size:1,zstd:9"``). A local path
    is written under a temporary name beside it, renamed once every example
    is written; a URL (``gs://``, ``s3://``, ...) through a local file copied
    there at the end. Either way, an error part way (a value that cannot be
    encoded, an ``examples`` iterator that raises) leaves nothing at ``path``.
    """
    target = storage.expand(path)
    if not storage.is_url(target):
        partial = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{uuid.uuid4().hex}.partial")
        try:
            _write_local(partial, target, examples, options)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return
    fs, remote = storage.filesystem(target)
    with tempfile.TemporaryDirectory(prefix="estimax-arrayrecord-") as scratch:
        local = os.path.join(scratch, "part.array_record")
        _write_local(local, target, examples, options)
        try:
            fs.put_file(local, remote)
        except OSError as error:
            raise StorageError(f"{target}: cannot be written ({error}); expected a writable location.") from None


def _write_local(local: str, name: str, examples: Iterable[Mapping[str, Any]], options: str) -> None:
    try:
        writer = _module().ArrayRecordWriter(local, options)
    except ValueError as error:  # bad options
        raise ConfigError(f"array_record.write(options={options!r}): {error}.") from None
    if not writer.ok():
        raise StorageError(
            f"{name}: cannot be written ({_status(writer)}); expected a path in an existing, writable directory."
        )
    try:
        for example in examples:
            writer.write(serialize(example))
    finally:
        writer.close()


def _check_spec(features: Any, label: str | None) -> None:
    if not isinstance(features, Mapping) or not all(isinstance(f, tfrecord.Feature) for f in features.values()):
        raise ConfigTypeError(
            f"array_record(features={features!r}); expected a dict of name -> Feature, e.g. "
            "{'image': Feature(np.uint8, (28, 28)), 'label': Feature(np.int32)}."
        )
    if label is not None and label not in features:
        raise ConfigError(
            f"array_record(label={label!r}) is not in the feature spec {sorted(features)}. "
            "Fix: add it to features, or name one of them."
        )


def source(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    features: Mapping[str, tfrecord.Feature],
    *,
    label: str | None = None,
    num_workers: int = 0,
    read_options: grain.ReadOptions | None = None,
) -> MapSource:
    """An input from ArrayRecord files of ``tf.train.Example`` (a path, glob, or list; local,
    ``gs://`` or any fsspec URL); see ``array_record``."""
    _check_spec(features, label)
    files = files_lib.expand(paths)
    catalog = Catalog(files)
    parser = Parser(features, label)
    return file_source(
        files, lambda some: Records(some, catalog), parser, num_workers=num_workers, read_options=read_options
    )


class ArrayRecord:
    """``array_record(paths, features, label=...)`` reads ArrayRecord files; ``array_record.write`` writes them.

    ``paths``: a path, a glob (``data/train-*.array_record``) or a list of
    them, local or ``gs://`` (read by the format's own reader), or any other
    fsspec URL (``s3://``, ``memory://``: copied to a local temporary
    directory first). ``features`` maps names to ``Feature``s, as for
    TFRecord files; ``label`` names the one used as labels. With at least as
    many files as processes, process ``i`` of ``n`` reads files ``i::n``;
    otherwise records ``i::n`` of all files. Random access: shuffled each
    epoch from the run's seed, resumed from the step, ``train(epochs=...)``
    works; ``num_workers > 0`` reads in Grain worker processes.
    """

    Feature = tfrecord.Feature
    write = staticmethod(write)

    def __call__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        features: Mapping[str, tfrecord.Feature],
        *,
        label: str | None = None,
        num_workers: int = 0,
        read_options: grain.ReadOptions | None = None,
    ) -> MapSource:
        return source(paths, features, label=label, num_workers=num_workers, read_options=read_options)

    def __repr__(self) -> str:
        return "estimax.data.array_record"


array_record = ArrayRecord()
"""``array_record(paths, features, label=...)``: a random-access source of ArrayRecord files of
``tf.train.Example`` records; ``array_record.write(path, examples)`` writes one, and
``array_record.Feature`` describes a feature."""
