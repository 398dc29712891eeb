"""The TFRecord framing: a record's length, the masked CRC32C of the length and of the data.

Shared by the TFRecord data reader and writer (``data/tfrecord.py``) and the
TensorBoard event files (``events.py``), which use the same framing. Owns the
bytes around a record, not what a record holds.
"""

from __future__ import annotations

import struct

import google_crc32c


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """``data`` as one TFRecord: length, CRC of the length, data, CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
