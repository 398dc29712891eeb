"""TFRecord files of ``tf.train.Example``, read without TensorFlow.

Owns the record framing (length, masked CRC32C of the length and of the data,
all verified), an index of record offsets per file for random access, the
``tf.train.Example`` message (declared here with protobuf, wire-compatible
with TensorFlow's), parsing it by a feature spec into numpy, a writer, and the
``tfrecord`` source (a Grain ``MapDataset`` over every record of the files).
A corrupt record raises an error naming the file and the record index.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from estimax import storage
from estimax.data import files as files_lib
from estimax.data.grain import MapSource, file_source
from estimax.errors import ConfigError, InputError
from estimax.records.tfrecord_framing import frame, masked_crc


def _example_class():
    """``tensorflow.Example`` declared in a private descriptor pool (no TensorFlow, no codegen)."""
    T = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="estimax/example.proto", package="tensorflow", syntax="proto3")

    def message(name, *fields, nested=()):
        m = proto.message_type.add(name=name)
        for number, (field, kind, type_name, label) in enumerate(fields, 1):
            m.field.add(name=field, number=number, type=kind, type_name=type_name, label=label)
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        return m

    repeated, optional = T.LABEL_REPEATED, T.LABEL_OPTIONAL
    message("BytesList", ("value", T.TYPE_BYTES, None, repeated))
    message("FloatList", ("value", T.TYPE_FLOAT, None, repeated))
    message("Int64List", ("value", T.TYPE_INT64, None, repeated))
    feature = message(
        "Feature",
        ("bytes_list", T.TYPE_MESSAGE, ".tensorflow.BytesList", optional),
        ("float_list", T.TYPE_MESSAGE, ".tensorflow.FloatList", optional),
        ("int64_list", T.TYPE_MESSAGE, ".tensorflow.Int64List", optional),
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry", options=descriptor_pb2.MessageOptions(map_entry=True))
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".tensorflow.Feature", label=optional)
    message("Features", ("feature", T.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry", repeated), nested=[entry])
    message("Example", ("features", T.TYPE_MESSAGE, ".tensorflow.Features", optional))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


Example = _example_class()


# -- records -----------------------------------------------------------------


def index_records(file: files_lib.File) -> list[tuple[int, int]]:
    """(offset, length) of every record's data in ``file``, checking each length's CRC."""
    index: list[tuple[int, int]] = []
    offset = 0
    with file.open() as f:
        while header := f.read(12):
            if len(header) < 12:
                raise InputError(f"{file.name}: record {len(index)} is truncated (a {len(header)}-byte header).")
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc(header[:8]) != length_crc:
                raise InputError(
                    f"{file.name}: record {len(index)} is corrupt: its length's CRC is {length_crc:#x}; "
                    f"expected {masked_crc(header[:8]):#x}."
                )
            index.append((offset + 12, length))
            offset += 12 + length + 4
            f.seek(offset)
    return index


class Records:
    """Every record of ``files`` in order, by position: a Grain ``RandomAccessDataSource``.

    Items are ``(file name, record index in its file, bytes)``; each record's
    data CRC is verified when read. Offsets are indexed on first use, into
    ``indexes`` (file name -> offsets), which sources over the same files share.
    """

    def __init__(self, files: Sequence[files_lib.File], indexes: dict | None = None):
        self.files = list(files)
        self._indexes = {} if indexes is None else indexes
        self._starts: np.ndarray | None = None

    def _index(self, file: files_lib.File) -> list[tuple[int, int]]:
        if file.name not in self._indexes:
            self._indexes[file.name] = storage.bounded("indexing the records", file.name, index_records, file)
        return self._indexes[file.name]

    def _first_records(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.cumsum([0] + [len(self._index(f)) for f in self.files])
        return self._starts

    def __len__(self) -> int:
        return int(self._first_records()[-1])

    def __getitem__(self, position: int):
        starts = self._first_records()
        file_number = int(np.searchsorted(starts, position, side="right")) - 1
        file, record = self.files[file_number], position - int(starts[file_number])
        offset, length = self._index(file)[record]
        data = file.read_range(offset, offset + length + 4)
        if len(data) < length + 4:
            raise InputError(f"{file.name}: record {record} is truncated ({len(data) - 4} of {length} bytes).")
        (crc,) = struct.unpack("<I", data[length:])
        if masked_crc(data[:length]) != crc:
            raise InputError(
                f"{file.name}: record {record} is corrupt: its data CRC is {crc:#x}; "
                f"expected {masked_crc(data[:length]):#x}."
            )
        return file.name, record, data[:length]


def serialize(features: Mapping[str, Any]) -> bytes:
    """One ``{name: values}`` example as a serialized ``tf.train.Example``.

    Floats go to ``float_list``, integers and booleans to ``int64_list``,
    ``bytes`` to ``bytes_list``; anything else (text, objects, complex numbers) is an ``InputError``.
    """
    example = Example()
    for name, value in features.items():
        feature = example.features.feature[name]
        if isinstance(value, bytes):
            feature.bytes_list.value.append(value)
            continue
        value = np.asarray(value).ravel()
        if value.dtype.kind not in "biuf":
            encode = f"{{{name!r}: text.encode()}} for one string, " if value.dtype.kind in "US" else ""
            raise InputError(
                f"Feature {name!r} has dtype {value.dtype}; a tf.train.Example feature holds floats (float_list), "
                f"integers or booleans (int64_list), or one bytes value (bytes_list). Fix: encode it, e.g. "
                f"{encode}or numeric ids."
            )
        if value.dtype.kind == "f":
            feature.float_list.value.extend(value.tolist())
        else:
            feature.int64_list.value.extend(value.astype(np.int64).tolist())
    return example.SerializeToString()


def write(path: str | os.PathLike, examples: Iterable[Mapping[str, Any]]) -> None:
    """Writes ``{name: values}`` examples as TFRecords of ``tf.train.Example`` (any fsspec path);
    values are encoded as ``serialize`` says."""
    import fsspec

    with fsspec.open(os.fspath(path), "wb") as f:
        for features in examples:
            f.write(frame(serialize(features)))


# -- examples ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Feature:
    """How to read one feature of a ``tf.train.Example``.

    ``shape`` is the shape of one example's value. With ``max_length``, the
    feature has a variable number of rows of ``shape`` (up to ``max_length``):
    it is padded with zeros to ``(max_length, *shape)`` and its row count is
    given as ``<name>_length``. A ``bytes_list`` of one value is decoded as raw
    ``dtype`` data (like ``tf.io.decode_raw``).
    """

    dtype: Any = np.float32
    shape: tuple[int, ...] = ()
    max_length: int | None = None


class Parser:
    """Turns the serialized examples of ``Records`` into ``(features, labels)`` by a spec."""

    def __init__(self, spec: Mapping[str, Feature], label: str | None):
        if label is not None and label not in spec:
            raise ConfigError(f"tfrecord(label={label!r}) is not in the feature spec {sorted(spec)}.")
        self.spec, self.label = dict(spec), label

    def __call__(self, item) -> tuple:
        file_name, record, data = item
        example = Example()
        try:
            example.ParseFromString(data)
        except Exception as error:  # protobuf's DecodeError: name the record
            raise InputError(f"{file_name}: record {record} is not a tf.train.Example ({error}).") from None
        present = example.features.feature
        values = {}
        for name, feature in self.spec.items():
            if name not in present:
                raise InputError(
                    f"{file_name}: record {record} has no feature {name!r}; expected the spec's "
                    f"{sorted(self.spec)} (found {sorted(present)})."
                )
            values.update(self._decode(name, feature, present[name], f"{file_name}: record {record}"))
        labels = None if self.label is None else values.pop(self.label)
        return values, labels

    def _decode(self, name: str, spec: Feature, feature, where: str) -> dict[str, np.ndarray | np.generic]:
        dtype = np.dtype(spec.dtype)
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            if len(feature.bytes_list.value) != 1:
                raise InputError(
                    f"{where}: feature {name!r} has {len(feature.bytes_list.value)} byte strings; expected one "
                    f"holding raw {dtype} data (text is not numeric: encode it as integers)."
                )
            values = np.frombuffer(feature.bytes_list.value[0], dtype)
        elif kind == "float_list" and dtype.kind != "f":
            raise InputError(f"{where}: feature {name!r} holds floats; expected {dtype} as the spec says.")
        else:
            values = np.asarray(getattr(feature, kind or "int64_list").value, dtype)
        row = int(np.prod(spec.shape))
        if spec.max_length is None:
            if values.size != row:
                raise InputError(
                    f"{where}: feature {name!r} has {values.size} values; expected {row} (shape {spec.shape})."
                )
            return {name: values.reshape(spec.shape)}
        rows, remainder = divmod(values.size, row)
        if remainder or rows > spec.max_length:
            raise InputError(
                f"{where}: feature {name!r} has {values.size} values; expected up to {spec.max_length} "
                f"rows of shape {spec.shape}."
            )
        padded = np.zeros((spec.max_length, *spec.shape), dtype)
        padded[:rows] = values.reshape((rows, *spec.shape))
        return {name: padded, f"{name}_length": np.int32(rows)}


def tfrecord(
    paths,
    features: Mapping[str, Feature],
    *,
    label: str | None = None,
    num_workers: int = 0,
    read_options: grain.ReadOptions | None = None,
) -> MapSource:
    """An input from TFRecord files of ``tf.train.Example`` (a path, glob, or list; any fsspec URL).

    ``features`` maps names to ``Feature``s; ``label`` names the one used as
    labels. With at least as many files as processes, process ``i`` of ``n``
    reads files ``i::n``; otherwise records ``i::n`` of all files. Random
    access (records are indexed on first use): shuffled each epoch, seekable
    by step, ``train(epochs=...)`` works.
    """
    indexes: dict[str, list[tuple[int, int]]] = {}  # shared by the shards' Records
    return file_source(
        files_lib.expand(paths),
        lambda files: Records(files, indexes),
        Parser(features, label),
        num_workers=num_workers,
        read_options=read_options,
    )
