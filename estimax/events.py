"""TensorBoard event files, encoded directly: scalars as ``tensorflow.Event`` records.

An event file is a sequence of TFRecords (``tfrecord_framing.py``), the first a
``file_version`` event, each next one an ``Event`` with a wall time, a step and
a ``Summary`` of ``simple_value`` scalars, the form TensorBoard's scalar
dashboard reads, or a ``SessionLog.START`` that marks where a run (re)started.
The protobuf wire format of these messages is written
here by hand: a training loop's every-step points cost a few microseconds each,
with no TensorFlow, tensorboardX or protobuf classes on the path. Owns the
bytes and the file names; does not own where they go (``writers.py``).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping

import numpy as np

from estimax.tfrecord_framing import frame

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

    def steps(self, first_step: int, columns: Mapping[str, np.ndarray], skip_nan: Iterable[str] = ()) -> bytes:
        """One event per step from ``first_step``: ``columns`` maps each tag to its per-step values.
        Tags in ``skip_nan`` have no point where they are NaN (values measured on some steps only)."""
        wall_time = time.time()
        rows = {tag: np.asarray(values, np.float64).tolist() for tag, values in columns.items()}
        sampled = [tag for tag in skip_nan if tag in rows]
        records = []
        for i in range(len(next(iter(rows.values()), ()))):
            point = {tag: values[i] for tag, values in rows.items() if tag not in sampled or values[i] == values[i]}
            records.append(self.event(first_step + i, point, wall_time))
        return b"".join(records)


def file_name() -> str:
    """``events.out.tfevents.<microseconds>.<host>.<pid>``: TensorBoard reads the files of a run in
    name order, so names sort in the order they were started."""
    return f"events.out.tfevents.{time.time_ns() // 1000:016d}.{socket.gethostname()}.{os.getpid()}"
