"""Summaries beyond scalars: images, histograms and text in the run's TensorBoard files, from a hook.

A hook's records carry a ``Summaries`` (``record.summaries``): ``image``,
``figure`` (a Matplotlib figure), ``histogram``, ``text`` and ``scalars``
write at the record's step under a split's tags (``train/...``,
``eval/...``) of the run's TensorBoard run, through the same writer, thread
and file as the run's scalars, so TensorBoard reads them in order with the
curves. On a process other than
0, without a model_dir or with ``RunConfig(tensorboard=False)``, they write
nothing (and still check what they are given, so a mistake shows on every
process). Owns the encoding of these values (``tensorflow.Summary.Value``:
``image``, ``histo``, and ``tensor`` with the text plugin's metadata, written
here by hand like ``events.py``'s scalars); does not own the files
(``writers.py``).
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Iterable, Mapping

import numpy as np

from estimax.errors import InputError
from estimax.records import events
from estimax.records.events import _length_delimited, _varint

# Field keys: (field number << 3) | wire type (0 varint, 1 64-bit, 2 length-delimited, 5 32-bit).
_VALUE, _TAG, _SIMPLE_VALUE = b"\x0a", b"\x0a", b"\x15"  # Summary.value; Summary.Value's tag, simple_value
_IMAGE, _HISTO, _TENSOR, _METADATA = b"\x22", b"\x2a", b"\x42", b"\x4a"  # Summary.Value's image, histo, ...
_TEXT_PLUGIN = _length_delimited(b"\x0a", _length_delimited(b"\x0a", b"text"))  # SummaryMetadata.plugin_data
_DT_STRING = b"\x08\x07"  # TensorProto.dtype = DT_STRING
_NULL_TENSOR = b"\x08\x01\x12\x04\x12\x02\x08\x00"  # a float TensorProto of shape (0,): the hparams plugin's
_SCALAR_SHAPE = b"\x12\x00"  # TensorProto.tensor_shape: a scalar


ALL_SPLITS = ""  # the split of a record of the whole run (its tag not named after a split)


class Summaries:
    """Writes images, figures, histograms, text and scalars into the run's TensorBoard files.

    Each method writes at ``step`` under ``split``'s tags (``image("kernel")`` in ``eval``: the tag
    ``eval/kernel``); both default to the record's. ``writers``: the call's TensorBoard writers (none where this process
    writes no files).
    """

    def __init__(self, writers=(), step: int = 0, split: str = "train"):
        self._writers, self.step, self.split = tuple(writers), step, split

    def at(self, step: int, split: str) -> Summaries:
        """The same writers, by default at ``step`` into ``split``."""
        return Summaries(self._writers, step, split)

    @property
    def writes(self) -> bool:
        """Whether anything written here reaches a file (process 0, a model_dir, TensorBoard on)."""
        return bool(self._writers)

    def image(self, tag: str, image, split: str | None = None, step: int | None = None) -> None:
        """``image``: ``(height, width)``, ``(height, width, 1|3|4)``; uint8, or floats in [0, 1]."""
        self._write_value(split, step, _value(self._tag(split, tag), _IMAGE, _image(tag, image)))

    def figure(self, tag: str, figure, split: str | None = None, step: int | None = None) -> None:
        """A Matplotlib figure, as a PNG image (the figure is not closed)."""
        if self._writers:  # rendering is the cost; nothing to check before it
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png")
            width, height = (int(round(x)) for x in figure.get_size_inches() * figure.get_dpi())
            image = _encoded_image(height, width, 4, buffer.getvalue())
            self._write_value(split, step, _value(self._tag(split, tag), _IMAGE, image))

    def histogram(self, tag: str, values, split: str | None = None, step: int | None = None, bins: int = 30) -> None:
        """The distribution of ``values`` (any shape, finite values only) in ``bins`` equal buckets."""
        self._write_value(split, step, _value(self._tag(split, tag), _HISTO, _histogram(tag, values, bins)))

    def text(self, tag: str, text: str, split: str | None = None, step: int | None = None) -> None:
        """Markdown text, shown by TensorBoard's text dashboard."""
        tensor = _DT_STRING + _SCALAR_SHAPE + _length_delimited(b"\x42", str(text).encode())
        body = _length_delimited(_TAG, self._tag(split, tag).encode()) + _length_delimited(_METADATA, _TEXT_PLUGIN)
        self._write_value(split, step, _length_delimited(_VALUE, body + _length_delimited(_TENSOR, tensor)))

    def scalars(self, values: Mapping[str, float], split: str | None = None, step: int | None = None) -> None:
        encoded = b"".join(
            _length_delimited(
                _VALUE, _length_delimited(_TAG, self._tag(split, tag).encode()) + _SIMPLE_VALUE + struct.pack("<f", v)
            )
            for tag, v in values.items()
        )
        self._write_value(split, step, encoded)

    def hparams(self, hparams: Mapping[str, object]) -> None:
        """The run's hyper-parameters for TensorBoard's HPARAMS tab, in the run of the curves the tab
        then shows against them."""
        self._write_value(ALL_SPLITS, 0, hparams_value(hparams))

    def _tag(self, split: str | None, tag: str) -> str:
        return events.tag(self.split if split is None else split, tag)

    def _write_value(self, split: str | None, step: int | None, values: bytes) -> None:
        for writer in self._writers:
            writer.write_summary(self.split if split is None else split, self.step if step is None else step, values)


def hparams_value(hparams: Mapping[str, object]) -> bytes:
    """TensorBoard's HPARAMS tab's record of a session: ``hparams`` (numbers, strings and booleans; anything
    else as its ``str``) in a ``HParamsPluginData.session_start_info`` under ``_hparams_/session_start_info``."""
    entries = b""
    for name, value in hparams.items():
        if isinstance(value, bool):
            kind = b"\x20" + _varint(int(value))  # google.protobuf.Value.bool_value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            kind = b"\x11" + struct.pack("<d", float(value))  # number_value
        else:
            kind = _length_delimited(b"\x1a", str(value).encode())  # string_value
        entry = _length_delimited(b"\x0a", str(name).encode()) + _length_delimited(b"\x12", kind)
        entries += _length_delimited(b"\x0a", entry)  # SessionStartInfo.hparams: a map entry
    content = b"\x08\x00" + _length_delimited(b"\x1a", entries)  # version 0, session_start_info
    plugin = _length_delimited(b"\x0a", _length_delimited(b"\x0a", b"hparams") + _length_delimited(b"\x12", content))
    tag = _length_delimited(_TAG, b"_hparams_/session_start_info")
    tensor = _length_delimited(_TENSOR, _NULL_TENSOR)
    return _length_delimited(_VALUE, tag + _length_delimited(_METADATA, plugin) + tensor)


OVERLAY_TAG = "custom_scalars__config__"  # the tag TensorBoard's CUSTOM SCALARS tab reads its layout from
_SPLITS_OF_A_METRIC = r"^(train|eval|eval_[^/]+)/{}$"  # a chart's tags: one metric in every split


def overlay_value(metrics: Iterable[str]) -> bytes:
    """TensorBoard's CUSTOM SCALARS tab's layout: a category "train and eval" with, per metric, one chart
    of it in every split (``train/loss``, ``eval/loss``, ``eval_val/loss`` as lines on one chart). A
    ``Layout`` (``plugins/custom_scalar/layout.proto``) as a string tensor, the form that tab reads."""
    charts = b""
    for metric in sorted(metrics):
        lines = _length_delimited(b"\x0a", _SPLITS_OF_A_METRIC.format(re.escape(metric)).encode())  # .tag
        chart = _length_delimited(b"\x0a", metric.encode()) + _length_delimited(b"\x12", lines)  # title, multiline
        charts += _length_delimited(b"\x12", chart)  # Category.chart
    layout = _length_delimited(b"\x12", _length_delimited(b"\x0a", b"train and eval") + charts)  # Layout.category
    plugin = _length_delimited(b"\x0a", _length_delimited(b"\x0a", b"custom_scalars"))
    metadata = plugin + b"\x20\x02"  # data_class: DATA_CLASS_TENSOR
    tensor = _DT_STRING + _SCALAR_SHAPE + _length_delimited(b"\x42", layout)
    body = _length_delimited(_TAG, OVERLAY_TAG.encode()) + _length_delimited(_METADATA, metadata)
    return _length_delimited(_VALUE, body + _length_delimited(_TENSOR, tensor))


def _value(tag: str, key: bytes, message: bytes) -> bytes:
    return _length_delimited(_VALUE, _length_delimited(_TAG, tag.encode()) + _length_delimited(key, message))


def _image(tag: str, image) -> bytes:
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or 0 in array.shape:
        raise InputError(
            f"Summaries.image({tag!r}) got an array of shape {array.shape}; expected (height, width) or "
            "(height, width, 1|3|4 channels). Fix: pass one image, not a batch (e.g. images[0])."
        )
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.integer):
            raise InputError(f"Summaries.image({tag!r}) got dtype {array.dtype}; expected uint8 or floats in [0, 1].")
        array = (np.clip(np.nan_to_num(array.astype(np.float64)), 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    height, width, channels = array.shape
    return _encoded_image(height, width, channels, _png(array))


def _encoded_image(height: int, width: int, channels: int, png: bytes) -> bytes:
    """A ``Summary.Image``: height, width, colorspace (the channels), the encoded PNG."""
    sizes = b"\x08" + _varint(height) + b"\x10" + _varint(width) + b"\x18" + _varint(channels)
    return sizes + _length_delimited(b"\x22", png)


def _png(array: np.ndarray) -> bytes:
    """``array`` (height, width, channels) of uint8 as a PNG file (8 bits, no interlace, filter 0)."""
    height, width, channels = array.shape
    color_type = {1: 0, 3: 2, 4: 6}[channels]  # grayscale, RGB, RGBA

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = np.concatenate([np.zeros((height, 1), np.uint8), array.reshape(height, width * channels)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    data = chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + data + chunk(b"IEND", b"")


def _histogram(tag: str, values, bins: int) -> bytes:
    """A ``HistogramProto``: min, max, count, sum, sum of squares, and ``bins`` buckets by upper limit."""
    x = np.asarray(values, np.float64).ravel()
    if not x.size or not np.isfinite(x).all():
        raise InputError(
            f"Summaries.histogram({tag!r}) got {x.size} values"
            + ("" if not x.size else f", {int((~np.isfinite(x)).sum())} of them NaN or Inf")
            + "; expected at least one value, all finite. Fix: filter the values first (x[np.isfinite(x)])."
        )
    counts, edges = np.histogram(x, bins=bins)
    doubles = lambda field, v: field + struct.pack("<d", float(v))  # noqa: E731
    packed = lambda field, a: _length_delimited(field, np.asarray(a, "<f8").tobytes())  # noqa: E731
    return (
        doubles(b"\x09", x.min())
        + doubles(b"\x11", x.max())
        + doubles(b"\x19", x.size)
        + doubles(b"\x21", x.sum())
        + doubles(b"\x29", np.square(x).sum())
        + packed(b"\x32", edges[1:])
        + packed(b"\x3a", counts)
    )
