"""TensorBoard event files, encoded directly: scalars as ``tensorflow.Event`` records.

An event file is a sequence of TFRecords (``tfrecord_framing.py``), the first a
``file_version`` event, each next one an ``Event`` with a wall time, a step and
a ``Summary`` of ``simple_value`` scalars, the form TensorBoard's scalar
dashboard reads, or a ``SessionLog.START`` that marks where a run (re)started.
The protobuf wire format of these messages is written
here by hand: a training loop's every-step points cost a few microseconds each,
with no TensorFlow, tensorboardX or protobuf classes on the path. Owns the
bytes, the tags and the file names; does not own where they go (``writers.py``).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping

import numpy as np

from estimax.records.tfrecord_framing import frame, frames

# Field keys of tensorflow.Event and tensorflow.Summary(.Value): (field number << 3) | wire type.
_WALL_TIME, _STEP, _FILE_VERSION, _SUMMARY, _SESSION_LOG = b"\x09", b"\x10", b"\x1a", b"\x2a", b"\x3a"
_VALUE, _TAG, _SIMPLE_VALUE = b"\x0a", b"\x0a", b"\x15"
_STATUS_START = b"\x08\x01"  # tensorflow.SessionLog: status = START


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(key: bytes, data: bytes) -> bytes:
    return key + _varint(len(data)) + data


def file_version(wall_time: float | None = None) -> bytes:
    """The first record of every event file."""
    wall_time = time.time() if wall_time is None else wall_time
    return frame(_WALL_TIME + struct.pack("<d", wall_time) + _length_delimited(_FILE_VERSION, b"brain.Event:2"))


def session_start(step: int, wall_time: float | None = None) -> bytes:
    """A ``SessionLog.START`` event at ``step``: TensorBoard's readers drop the events at ``step`` and after
    that they read before it (a run that died past its last checkpoint), and keep reading this run's.
    TensorBoard's server takes a logdir's first one for its start, not a restart: every run writes one."""
    wall_time = time.time() if wall_time is None else wall_time
    start = _length_delimited(_SESSION_LOG, _STATUS_START)
    return frame(_WALL_TIME + struct.pack("<d", wall_time) + _STEP + _varint(step) + start)


def summary_event(step: int, values: bytes, wall_time: float | None = None) -> bytes:
    """One framed event at ``step`` of encoded ``Summary.Value`` messages (``summaries.py``)."""
    wall_time = time.time() if wall_time is None else wall_time
    head = _WALL_TIME + struct.pack("<d", wall_time) + _STEP + _varint(step)
    return frame(head + _length_delimited(_SUMMARY, values))


class ScalarEncoder:
    """Encodes scalar events; the encoded prefix of each tag is kept, as a run logs the same few names."""

    def __init__(self):
        self._tags: dict[str, bytes] = {}

    def _value_prefix(self, tag: str) -> bytes:
        prefix = self._tags.get(tag)
        if prefix is None:
            tag_field = _length_delimited(_TAG, tag.encode())
            # A Summary.Value is its tag and a 4-byte float: its length is known before the value.
            prefix = self._tags[tag] = _VALUE + _varint(len(tag_field) + 5) + tag_field + _SIMPLE_VALUE
        return prefix

    def event(self, step: int, values: Mapping[str, float], wall_time: float) -> bytes:
        """One framed event of ``values`` at ``step``."""
        summary = b"".join(self._value_prefix(tag) + struct.pack("<f", value) for tag, value in values.items())
        return frame(
            _WALL_TIME + struct.pack("<d", wall_time) + _STEP + _varint(step) + _length_delimited(_SUMMARY, summary)
        )

    def steps(
        self,
        first_step: int,
        columns: Mapping[str, np.ndarray],
        skip_nan: Iterable[str] = (),
        wall_times: np.ndarray | None = None,
    ) -> bytes:
        """One event per step from ``first_step``: ``columns`` maps each tag to its per-step values.
        Tags in ``skip_nan`` have no point where they are NaN (values measured on some steps only).
        ``wall_times``: each step's, in seconds since the epoch (default: now).

        The steps are grouped by the tags their points have (a loop's steps: those without a
        sampled value, and its last step with them); each group is encoded with numpy in one go
        (``_same_tags``), and the groups' runs of steps are joined back in step order."""
        tags = list(columns)
        if not tags or not len(columns[tags[0]]):
            return b""
        values = np.column_stack([np.asarray(columns[tag], np.float64) for tag in tags])
        times = np.full(len(values), time.time()) if wall_times is None else np.asarray(wall_times, np.float64)
        # Which tags each step has a point for: all but the NaN of the tags in ``skip_nan``, whose
        # pattern is a step's kind (a bit a sampled tag: the engine samples one, grad_norm).
        skip = frozenset(skip_nan)
        sampled = [i for i, tag in enumerate(tags) if tag in skip]
        missing = np.zeros(len(values), np.int64)
        for bit, i in enumerate(sampled):
            missing |= np.isnan(values[:, i]).astype(np.int64) << bit
        kinds, kind = np.unique(missing, return_inverse=True)
        encoded, position = [], np.empty(len(values), np.int64)
        for k, pattern in enumerate(kinds.tolist()):
            rows = np.flatnonzero(kind == k)
            position[rows] = np.arange(len(rows))
            gone = {sampled[bit] for bit in range(len(sampled)) if pattern >> bit & 1}
            present = [i for i in range(len(tags)) if i not in gone]
            named = [tags[i] for i in present]
            encoded.append(self._same_tags(first_step + rows, named, values[np.ix_(rows, present)], times[rows]))
        parts = []
        starts = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist()]
        for start, stop in zip(starts, [*starts[1:], len(values)], strict=True):  # a run of steps of one kind
            data, ends = encoded[kind[start]]
            first, last = position[start], position[stop - 1]
            parts.append(data[(ends[first - 1] if first else 0) : ends[last]])
        return b"".join(parts)

    def _same_tags(
        self, steps: np.ndarray, tags: list[str], values: np.ndarray, wall_times: np.ndarray
    ) -> tuple[bytes, np.ndarray]:
        """Events of ``values`` (one row per step of the ascending ``steps``, a column per tag) at
        ``wall_times``, as ``event`` encodes them, built as one byte array per length of the step's
        varint; with the byte offset where each row's record ends."""
        widths = 1 + (steps[:, None] >= (1 << (7 * np.arange(1, 9, dtype=np.int64)))).sum(axis=1)
        prefixes = [self._value_prefix(tag) for tag in tags]
        summary = sum(len(prefix) + 4 for prefix in prefixes)
        tail = _SUMMARY + _varint(summary)
        head = len(_WALL_TIME) + 8 + len(_STEP)  # the wall time's key and double, the step's key
        floats, times = values.astype("<f4"), np.asarray(wall_times, "<f8")
        parts = []
        for width in np.unique(widths).tolist():  # steps ascend: each width is one run of rows
            rows = widths == width
            count = int(rows.sum())
            data = np.empty((count, head + width + len(tail) + summary), np.uint8)
            data[:, 0] = _WALL_TIME[0]
            data[:, 1:9] = np.ascontiguousarray(times[rows]).view(np.uint8).reshape(count, 8)
            data[:, 9] = _STEP[0]
            at = head
            for j in range(width):  # the step's varint: 7 bits a byte, the high bit on all but the last
                data[:, at + j] = ((steps[rows] >> (7 * j)) & 0x7F) | (0x80 if j < width - 1 else 0)
            at += width
            data[:, at : at + len(tail)] = np.frombuffer(tail, np.uint8)
            at += len(tail)
            for k, prefix in enumerate(prefixes):
                data[:, at : at + len(prefix)] = np.frombuffer(prefix, np.uint8)
                data[:, at + len(prefix) : at + len(prefix) + 4] = (
                    np.ascontiguousarray(floats[rows, k]).view(np.uint8).reshape(count, 4)
                )
                at += len(prefix) + 4
            parts.append(frames(data))
        # A framed record: 8 bytes of length, 4 of its CRC, the event, 4 of the event's CRC.
        ends = np.cumsum(16 + head + widths + len(tail) + summary)
        return b"".join(parts), ends


FILE_PREFIX = "events.out.tfevents."


def tag(split: str, name: str) -> str:
    """The tag of ``name`` in ``split``'s part of a run: ``train/loss``, ``eval/accuracy``,
    ``eval_<set>/accuracy`` (TensorBoard groups a run's tags by what comes before the first ``/``);
    ``name`` itself for split ``""`` (the run's hparams)."""
    return f"{split}/{name}" if split else name


def file_name() -> str:
    """``events.out.tfevents.<microseconds>.<host>.<pid>``: TensorBoard reads the files of a run in
    name order, so names sort in the order they were started."""
    return f"{FILE_PREFIX}{time.time_ns() // 1000:016d}.{socket.gethostname()}.{os.getpid()}"
