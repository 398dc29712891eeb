"""The TFRecord framing: a record's length, the masked CRC32C of the length and of the data.

Shared by the TFRecord data reader and writer (``data/tfrecord.py``) and the
TensorBoard event files (``events.py``), which use the same framing. Owns the
bytes around a record, not what a record holds.
"""

from __future__ import annotations

import functools
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
    does, in order, their CRCs computed together (``_crcs``)."""
    count, size = records.shape
    length = struct.pack("<Q", size)
    masked = _masked(_crcs(records))
    out = np.empty((count, 12 + size + 4), np.uint8)
    out[:, :12] = np.frombuffer(length + struct.pack("<I", masked_crc(length)), np.uint8)
    out[:, 12:-4] = records
    out[:, -4:] = masked.astype("<u4").view(np.uint8).reshape(count, 4)
    return out.tobytes()


def _crcs(records: np.ndarray) -> np.ndarray:
    """The CRC32C of each row of ``records``. Many rows that differ in a few byte columns (a run's
    events: the steps, the values) take a few CRC calls in all instead of one a row: for messages
    of one length a CRC is affine in their bits, so a row's CRC is the first row's XOR, for each bit
    in which it differs from the first row, that bit's own term (``_bit_terms``)."""
    count, size = records.shape
    if count < 256:  # 8 CRC calls per differing column cost more than a call per row
        blob = records.tobytes()
        return np.fromiter((google_crc32c.value(blob[i : i + size]) for i in range(0, len(blob), size)), np.uint32)
    crcs = np.full(count, google_crc32c.value(records[0].tobytes()), np.uint32)
    for column in np.flatnonzero((records != records[0]).any(axis=0)).tolist():
        crcs ^= _bit_terms(size, column)[records[:, column] ^ records[0, column]]
    return crcs


@functools.cache
def _bit_terms(size: int, column: int) -> np.ndarray:
    """For each byte ``d`` (256 entries): what XOR-ing ``d`` into byte ``column`` of any ``size``-byte
    message XORs into its CRC32C (``crc(m ^ e) = crc(m) ^ crc(e) ^ crc(0)``, one bit at a time)."""
    zero = google_crc32c.value(bytes(size))
    terms = np.zeros(256, np.uint32)
    for bit in range(8):
        one = bytearray(size)
        one[column] = 1 << bit
        terms[(np.arange(256) >> bit) & 1 == 1] ^= google_crc32c.value(bytes(one)) ^ zero
    terms.flags.writeable = False  # cached: shared by every later call
    return terms
