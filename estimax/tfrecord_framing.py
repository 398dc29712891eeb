"""The TFRecord framing: a record's length, the masked CRC32C of the length and of the data.

Shared by the TFRecord data reader and writer (``data/tfrecord.py``) and the
TensorBoard event files (``events.py``), which use the same framing. Owns the
bytes around a record, not what a record holds.
"""

from __future__ import annotations

import struct

import google_crc32c
import numpy as np


def masked_crc(data: bytes) -> int:
    return _masked(google_crc32c.value(data))


def _masked(crc):
    """TFRecord's mask of a CRC32C: of an int, or of each of a numpy ``uint32`` array's."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """``data`` as one TFRecord: length, CRC of the length, data, CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def frames(records: np.ndarray) -> bytes:
    """Each row of ``records`` (``uint8``, one record of the same size per row) framed as ``frame``
    does, in order: many records for the cost of one CRC call each."""
    count, size = records.shape
    length = struct.pack("<Q", size)
    blob = records.tobytes()
    crcs = np.fromiter((google_crc32c.value(blob[i : i + size]) for i in range(0, len(blob), size)), np.uint32, count)
    masked = _masked(crcs)
    out = np.empty((count, 12 + size + 4), np.uint8)
    out[:, :12] = np.frombuffer(length + struct.pack("<I", masked_crc(length)), np.uint8)
    out[:, 12:-4] = records
    out[:, -4:] = masked.astype("<u4").view(np.uint8).reshape(count, 4)
    return out.tobytes()
